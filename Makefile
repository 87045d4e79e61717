# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv if missing, install the pinned dependencies, build the
# extension incrementally (CMake + ninja under build/), then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.deps-stamp
# CUDA architectures for the CUDA backend (CMake syntax); 90 = H100/H200.
CUDA_ARCHS ?= 90

.PHONY: all venv build emu titan demo test test-fast test-emulated mutants lint compile-check bench-deps clean

all: build

$(STAMP): requirements.txt requirements-dev.txt requirements-extras.txt setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt \
		-r requirements-extras.txt
	$(BIN)/pip install -v --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

build: $(STAMP)
	CUDASNAP_CUDA_ARCHS="$(CUDA_ARCHS)" $(BIN)/python setup.py -q build_ext --inplace

# torchtitan and its own requirements for tests/e2e/test_torchtitan.py, beside the venv
# (requirements-titan.txt says why not in it).
TITAN := build/titan-site
$(TITAN)/.stamp: requirements-titan.txt $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --upgrade --target $(TITAN) \
		-r requirements-titan.txt
	touch $@

titan: $(TITAN)/.stamp

# The emulated CUDA runtime (tools/cudaemu) the CUDA tests run under.
emu: $(STAMP)
	$(BIN)/python tools/cudaemu/build.py

demo: build
	$(BIN)/python -m cudasnap demo

# ruff, mypy, and the GPU runner's workflow against GitHub's workflow schema.
lint: $(STAMP)
	$(BIN)/ruff check cudasnap tests bench tools
	$(BIN)/mypy cudasnap
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml

# Every C++/CUDA source against the headers of other torch releases (2.6, 2.11,
# 2.15; fetched once into build/torch-headers) as well as the installed one.
compile-check: $(STAMP)
	$(BIN)/python tools/compile_check.py

# Two lanes: every test on the CPU, then the CUDA path (tests/cuda_emu) in its own
# process under the emulated CUDA runtime, with the real CUDA build of torch on top.
test: build emu titan lint compile-check
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory test-emulated
	$(MAKE) --no-print-directory mutants

# The edit-test loop: the CPU tests not marked slow (81 s on 2 quiet cores, 2026-12-04;
# a test over ~1.5 s there is marked slow), against 15-25 min for `make test`, which
# still runs everything before a change lands.
test-fast: build
	$(BIN)/python -m pytest -q -m "not slow" tests

# A test of the emulated lane that runs longer than this (s) fails with every thread's stack.
EMU_TEST_TIMEOUT ?= 300

test-emulated: build emu
	tools/cudaemu/run.sh $(BIN)/python -m pytest -q -o timeout=$(EMU_TEST_TIMEOUT) tests/cuda_emu

# Held-out mistakes of the CUDA path (tools/cudaemu/mutants.py): the lane's ordering tests must
# fail on each, in a scratch copy built once; the unmutated copy must pass.
mutants: build emu
	$(BIN)/python tools/cudaemu/mutants.py --baseline

# The peers bench/peers.py compares against (torchsnapshot, DLRover), outside the venv.
bench-deps: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --upgrade \
		--target build/bench-peers -r requirements-bench.txt

clean:
	rm -rf build cudasnap/_C*.so
