#!/usr/bin/env bash
# The one command for a lent GPU machine: build the CUDA backend, run the GPU tests,
# run bench/gpu_bench.py, print a table LAST. Runs from any directory (cd's to the repo
# root), needs no network and no .venv: it uses the machine's own python3 + torch.
#
#   bash bench/gpu_check.sh [--budget S] [--quick] [--no-build] [--no-tests] [--no-bench]
#                           [--dry-run]
#
# Phases (each timestamped; with $OUT set, everything is teed to $OUT/gpu_check.log and
# build.log, pytest.log, gpu_tests.xml, gpu_results.json, gpu_results.txt land there):
#   detect   nvidia-smi / /dev/nvidia*, then torch.cuda in $PY; no GPU: prints
#            "skipped: no CUDA device (...)" and exits 0 before anything expensive
#   env      python, torch, nvcc, cmake, driver, PCIe link, clocks, /dev/shm, disk
#   build    CUDASNAP_REQUIRE_CUDA=1 $PY setup.py build_ext --inplace (build/gpu-cmake),
#            against whatever python3 + torch the machine has (2.6 to 2.15)
#   preflight at most ~30 s: /dev/shm free space, a small Snapshotter on the GPU (arena in
#            /dev/shm, cudaHostRegister), one submit + fence + flush, every fallback reason
#   tests    $PY -m pytest -m gpu on the test files that hold GPU tests
#   bench    $PY bench/gpu_bench.py --budget <what is left, at most 420 s>
#   summary  phase table, pytest's summary line, the bench table; also written, dated, to
#            $LOGDIR/gpu_check_table.md (for bench/RESULTS.md; the CI artifact)
#
# --budget S  wall seconds for the whole script (default 540, 300 with --quick; run it with
#             a tool timeout of at least S + 30). --quick: bench smoke sizes, fits 5 minutes. --dry-run: print the plan
#             and the GPU detection result, run nothing. Environment: PYTHON (interpreter
#             to use), CUDASNAP_CUDA_ARCHS (default 90), CUDA_HOME; CUDASNAP_GPU_CHECK_FAKE=1
#             checks this script itself without a GPU (detection passes, the bench runs
#             with --cpu-smoke; combine with --no-build to leave the built extension alone).
# Exit: 0 when every phase that ran succeeded (missed bench targets are measurements,
# not failures: see the table) or when there is no GPU; 1 otherwise.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
T0=$(date +%s)
BUDGET=""
QUICK=0 DRY=0 DO_BUILD=1 DO_TESTS=1 DO_BENCH=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
    --budget=*) BUDGET=${1#*=}; shift ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --no-build) DO_BUILD=0; shift ;;
    --no-tests) DO_TESTS=0; shift ;;
    --no-bench) DO_BENCH=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$BUDGET" ]]; then if (( QUICK )); then BUDGET=300; else BUDGET=540; fi; fi
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget must be whole seconds" >&2; exit 2; }

export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
log() { printf '[%s +%4ss] %s\n' "$(date -u +%H:%M:%S)" "$(elapsed)" "$*"; }
min() { if (( $1 < $2 )); then echo "$1"; else echo "$2"; fi; }

PH_NAMES=() PH_STATUS=() PH_SECS=()
PH_T=0
phase() { PH_T=$(date +%s); echo; log "==> phase $1"; }
phase_end() {  # name status
  local s=$(( $(date +%s) - PH_T ))
  PH_NAMES+=("$1") PH_STATUS+=("$2") PH_SECS+=("$s")
  log "<== phase $1: $2 (${s} s)"
}

has_torch() {
  "$1" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' >/dev/null 2>&1
}
pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  local c
  for c in .venv/bin/python python3 python; do
    if command -v "$c" >/dev/null 2>&1 && has_torch "$c"; then echo "$c"; return; fi
  done
  echo python3
}
PY=$(pick_python)

SKIP_WHY="" GPU_LINE=""
PROBE='
import os, sys
try:
    import torch
except Exception as e:
    print("NOTORCH", type(e).__name__, e); sys.exit(0)
try:
    ok, why = torch.cuda.is_available(), "torch.cuda.is_available() is False"
except Exception as e:
    ok, why = False, "torch.cuda raised %s: %s" % (type(e).__name__, e)
if not ok:
    print("NOCUDA", why, "(torch %s, CUDA %s, CUDA_VISIBLE_DEVICES=%r)"
          % (torch.__version__, torch.version.cuda, os.environ.get("CUDA_VISIBLE_DEVICES")))
    sys.exit(0)
p = torch.cuda.get_device_properties(0)
print("GPU %d x %s (sm_%d%d, %.0f GiB), torch %s, CUDA %s" % (torch.cuda.device_count(), p.name,
      p.major, p.minor, p.total_memory / 2**30, torch.__version__, torch.version.cuda))
'
# 0: GPU usable; 1: no GPU (SKIP_WHY); 2: a GPU but no usable torch (SKIP_WHY)
detect_gpu() {
  local smi="" out
  if [[ "${CUDASNAP_GPU_CHECK_FAKE:-}" == 1 ]]; then
    GPU_LINE="none (CUDASNAP_GPU_CHECK_FAKE=1: checking the script; bench --cpu-smoke)"
    return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then smi=nvidia-smi
  elif [[ -x /usr/local/nvidia/bin/nvidia-smi ]]; then smi=/usr/local/nvidia/bin/nvidia-smi
  fi
  if [[ -z "$smi" ]] && ! compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
    SKIP_WHY="nvidia-smi not found and no /dev/nvidia* device node"
    return 1
  fi
  if [[ -n "$smi" ]]; then
    out=$("$smi" -L 2>&1) || true
    if ! grep -q '^GPU ' <<<"$out"; then
      SKIP_WHY="nvidia-smi lists no GPU: $(head -n1 <<<"$out")"
      return 1
    fi
    echo "$out"
  fi
  out=$("$PY" -c "$PROBE" 2>/dev/null | tail -n1) || true
  case "$out" in
    GPU*) GPU_LINE=${out#GPU }; return 0 ;;
    NOCUDA*) SKIP_WHY="${out#NOCUDA }"; return 1 ;;
    NOTORCH*) SKIP_WHY="a GPU is present but $PY cannot import torch: ${out#NOTORCH }"; return 2 ;;
    *) SKIP_WHY="a GPU is present but the torch probe in $PY failed: ${out:-no output}"; return 2 ;;
  esac
}

find_cuda_home() {  # exports CUDA_HOME when unset and a toolkit is found; prints it
  local d nvcc
  if [[ -n "${CUDA_HOME:-}" && -f "$CUDA_HOME/include/cuda_runtime.h" ]]; then echo "$CUDA_HOME"; return; fi
  for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13 /opt/cuda; do
    if [[ -f "$d/include/cuda_runtime.h" && -x "$d/bin/nvcc" ]]; then export CUDA_HOME=$d; echo "$d"; return; fi
  done
  nvcc=$(command -v nvcc || true)
  if [[ -n "$nvcc" ]]; then
    d=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    if [[ -f "$d/include/cuda_runtime.h" ]]; then export CUDA_HOME=$d; echo "$d"; return; fi
  fi
  # the pip wheels (nvidia-cuda-nvcc & co.) next to torch
  d=$("$PY" -c 'import os, torch; r = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13"); print(r if os.path.exists(os.path.join(r, "include", "cuda_runtime.h")) and os.path.exists(os.path.join(r, "bin", "nvcc")) else "")' 2>/dev/null || true)
  if [[ -n "$d" ]]; then export CUDA_HOME=$d; echo "$d"; return; fi
  echo "(none found: setup.py will look for nvcc itself)"
}

GPU_TEST_FILES=$(grep -l 'mark\.gpu' tests/test_*.py 2>/dev/null | tr '\n' ' ' || true)
BUILD_DIR="$REPO/build/gpu-cmake"
ARCHS=${CUDASNAP_CUDA_ARCHS:-90}

if (( DRY )); then
  echo "gpu_check.sh --dry-run (budget ${BUDGET} s; nothing is built or run)"
  echo "  repo:   $REPO"
  echo "  python: $PY"
  echo "  logs:   ${OUT:-<a fresh /tmp/cudasnap-gpu-check.* directory>}"
  (( DO_BUILD )) && echo "  build:  CUDASNAP_REQUIRE_CUDA=1 CUDASNAP_CUDA_ARCHS=$ARCHS CUDASNAP_BUILD_DIR=$BUILD_DIR $PY setup.py build_ext --inplace"
  (( DO_BUILD )) || echo "  build:  skipped (--no-build)"
  echo "  preflight: /dev/shm free, Snapshotter on cuda:0 (arena in /dev/shm), submit + fence + flush, fallback reasons (<= 45 s)"
  (( DO_TESTS )) && echo "  tests:  $PY -m pytest -m gpu -q -rfEs $GPU_TEST_FILES"
  (( DO_BENCH )) && echo "  bench:  $PY bench/gpu_bench.py --budget <left, <= 420>$( (( QUICK )) && echo ' --quick')"
  rc=0; detect_gpu >/dev/null || rc=$?
  case $rc in
    0) echo "  detect: GPU found: $GPU_LINE" ;;
    1) echo "  detect: skipped: no CUDA device ($SKIP_WHY)" ;;
    *) echo "  detect: ERROR: $SKIP_WHY" ;;
  esac
  exit 0
fi

LOGDIR=${OUT:-}

main() {
  local rc=0 t
  log "cudasnap gpu_check: repo $REPO, python $PY, budget ${BUDGET} s"
  phase detect
  detect_gpu || rc=$?
  if (( rc == 1 )); then
    phase_end detect "no GPU"
    echo "skipped: no CUDA device ($SKIP_WHY)"
    return 0
  elif (( rc != 0 )); then
    phase_end detect FAILED
    echo "ERROR: $SKIP_WHY"
    return 1
  fi
  log "GPU: $GPU_LINE"
  phase_end detect ok
  if [[ -z "$LOGDIR" ]]; then LOGDIR=$(mktemp -d /tmp/cudasnap-gpu-check.XXXXXX); fi
  mkdir -p "$LOGDIR"
  log "logs in $LOGDIR"

  phase env
  {
    echo "python: $(command -v "$PY") $("$PY" -c 'import sys; print(sys.version.split()[0])')"
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>/dev/null || true
    "$PY" -c 'import cupy; print("cupy", cupy.__version__)' 2>/dev/null || echo "cupy: not importable (bench uses torch copies)"
    "$PY" -c 'import pybind11; print("pybind11", pybind11.__version__)' 2>/dev/null || echo "pybind11: MISSING (the build needs it)"
    "$PY" -c 'import pytest; print("pytest", pytest.__version__)' 2>/dev/null || echo "pytest: MISSING"
    "$PY" -c 'import os, sysconfig; d = sysconfig.get_paths()["include"]; print("Python.h:", d, "ok" if os.path.exists(os.path.join(d, "Python.h")) else "MISSING (the build needs the Python headers)")' 2>/dev/null || true
    echo "CUDA_HOME: $(find_cuda_home)"
    echo "nvcc: $(command -v nvcc || echo none on PATH) $( (nvcc --version 2>/dev/null || "${CUDA_HOME:-/nonexistent}/bin/nvcc" --version 2>/dev/null) | grep -o 'release [0-9.]*' | head -n1)"
    echo "cmake: $( (PATH="$(dirname "$(command -v "$PY")"):$PATH" cmake --version 2>/dev/null || echo none) | head -n1)"
    echo "ninja: $( (PATH="$(dirname "$(command -v "$PY")"):$PATH" ninja --version 2>/dev/null) || echo none)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>/dev/null || true
    echo "cores: $(nproc)"; free -g | head -n2 || true
    df -h /dev/shm "$REPO" /var/tmp /tmp 2>/dev/null || true
  } 2>&1 | sed 's/^/   /'
  # find_cuda_home ran in a subshell above: export for the build here too
  find_cuda_home >/dev/null || true
  phase_end env ok

  local build_ok=1
  if (( DO_BUILD )); then
    phase build
    t=$(min 300 $(( $(left) - 150 )))
    (( t < 60 )) && t=60
    log "CUDASNAP_REQUIRE_CUDA=1 CUDASNAP_CUDA_ARCHS=$ARCHS $PY setup.py build_ext --inplace (timeout ${t} s, log $LOGDIR/build.log)"
    rc=0
    CUDASNAP_REQUIRE_CUDA=1 CUDASNAP_CUDA_ARCHS=$ARCHS CUDASNAP_BUILD_DIR=$BUILD_DIR \
      timeout -k 10 "$t" "$PY" setup.py build_ext --inplace >"$LOGDIR/build.log" 2>&1 || rc=$?
    if (( rc == 0 )); then
      "$PY" -c 'import torch; from cudasnap import _C; b = _C.BUILD_INFO; print("   BUILD_INFO", b); assert "cuda" in b["backends"], "CUDA backend missing"' 2>&1 || rc=$?
    fi
    if (( rc != 0 )); then
      build_ok=0
      echo "   build FAILED (rc $rc$( (( rc == 124 )) && echo ', timed out')); last lines of build.log:"
      tail -n 60 "$LOGDIR/build.log" | sed 's/^/   | /'
      phase_end build "FAILED rc=$rc"
    else
      grep -E 'CUDA backend|error:|warning: ' "$LOGDIR/build.log" | head -n 20 | sed 's/^/   /' || true
      phase_end build ok
    fi
  fi

  if (( build_ok )); then
    phase preflight
    rc=0
    local dev=cuda pt=45
    # faked (CPU test of this script, maybe on a loaded machine): more time
    [[ "${CUDASNAP_GPU_CHECK_FAKE:-}" == 1 ]] && dev=cpu pt=120
    log "preflight on $dev (timeout $pt s)"
    set +e
    CUDASNAP_PREFLIGHT_DEVICE=$dev timeout -k 5 "$pt" "$PY" - <<'PYEOF' 2>&1 | sed 's/^/   /'

import os, shutil, tempfile, time
t0 = time.monotonic()
du = shutil.disk_usage("/dev/shm")
print(f"/dev/shm: {du.free / 2**30:.1f} GiB free of {du.total / 2**30:.1f} GiB")
import torch
import cudasnap
dev = os.environ["CUDASNAP_PREFLIGHT_DEVICE"]
info = cudasnap.build_info()
print(f"build_info: backends {info['backends']}, built against torch {info['torch_built_against']}, "
      f"CUDA {info['cuda_version']}, archs {info['cuda_architectures']}")
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
d = tempfile.mkdtemp(prefix="cudasnap-preflight-")
snap = cudasnap.Snapshotter(model, opt, directory=d, backend="cuda" if dev == "cuda" else "auto", keep=1)
try:
    model(torch.randn(4, 512, device=dev)).sum().backward()
    opt.step()
    snap.boundary(1)                      # one submit (copy of every tensor into the arena)
    path = snap.flush(wait=True, timeout=20)  # fence: waits for the copy, then writes it out
    print(f"submit + fence + flush: ok ({path})")
    st = snap.stats()
    def reasons(obj, prefix=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from reasons(v, f"{prefix}{k}.")
        elif any(w in prefix.lower() for w in ("reason", "fallback", "error")):
            yield prefix[:-1], obj
    found = list(reasons(st))
    for k, v in found:
        print(f"fallback/reason {k}: {v}")
    if not found:
        print("fallback/reason: (stats() reports none)")
finally:
    snap.close()
    shutil.rmtree(d, ignore_errors=True)
print(f"preflight done in {time.monotonic() - t0:.1f} s")
PYEOF
    rc=${PIPESTATUS[0]}
    set -e
    if (( rc == 0 )); then phase_end preflight ok; else phase_end preflight "FAILED rc=$rc"; fi
  fi

  local tests_line="(not run)"
  if (( DO_TESTS )) && (( build_ok )); then
    phase tests
    t=$(min 240 $(( $(left) - 150 )))
    (( t < 60 )) && t=60
    local topt=()
    "$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && topt=(--timeout=180)
    log "$PY -m pytest -m gpu $GPU_TEST_FILES (timeout ${t} s)"
    rc=0
    set +e
    # shellcheck disable=SC2086  # the file list is split on purpose
    timeout -k 10 "$t" "$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider \
      --junitxml="$LOGDIR/gpu_tests.xml" ${topt[@]+"${topt[@]}"} $GPU_TEST_FILES 2>&1 | tee "$LOGDIR/pytest.log"
    rc=${PIPESTATUS[0]}
    set -e
    tests_line=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$LOGDIR/pytest.log" | tail -n1 || true)
    [[ -n "$tests_line" ]] || tests_line="(no summary line; rc $rc)"
    (( rc == 124 )) && tests_line="TIMED OUT after ${t} s; last: $tests_line"
    if (( rc == 0 )); then phase_end tests ok; else phase_end tests "FAILED rc=$rc"; fi
  elif (( DO_TESTS )); then
    PH_NAMES+=(tests) PH_STATUS+=("not run (build failed)") PH_SECS+=(0)
  fi

  if (( DO_BENCH )) && (( build_ok )); then
    phase bench
    t=$(min 420 $(( $(left) - 20 )))
    local q=()
    (( QUICK )) && q=(--quick)
    [[ "${CUDASNAP_GPU_CHECK_FAKE:-}" == 1 ]] && q+=(--cpu-smoke)
    if (( t < 150 )) && (( ! QUICK )); then
      log "only ${t} s left: bench runs with --quick"; q=(--quick)
    fi
    (( t < 30 )) && t=30
    log "$PY bench/gpu_bench.py --budget $t ${q[*]} --out $LOGDIR"
    rc=0
    timeout -k 15 $(( t + 45 )) "$PY" bench/gpu_bench.py --budget "$t" ${q[@]+"${q[@]}"} --out "$LOGDIR" || rc=$?
    case $rc in
      0) phase_end bench ok ;;
      3) phase_end bench "PARTIAL (watchdog)" ;;
      *) phase_end bench "FAILED rc=$rc" ;;
    esac
  elif (( DO_BENCH )); then
    PH_NAMES+=(bench) PH_STATUS+=("not run (build failed)") PH_SECS+=(0)
  fi

  echo
  echo "================ cudasnap gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ================"
  echo "GPU: $GPU_LINE"
  local i bad=0
  for i in "${!PH_NAMES[@]}"; do
    printf '  %-8s %6ss  %s\n' "${PH_NAMES[$i]}" "${PH_SECS[$i]}" "${PH_STATUS[$i]}"
    [[ "${PH_STATUS[$i]}" == ok ]] || bad=1
  done
  printf '  %-8s %6ss  %s\n' total "$(elapsed)" "(budget ${BUDGET} s)"
  echo "tests: $tests_line"
  {
    echo "### gpu_check $(date -u +%Y-%m-%d) ($(date -u +%H:%M) UTC)$( (( QUICK )) && echo ', --quick')"
    echo
    echo "GPU: $GPU_LINE"
    echo
    echo "| phase | seconds | status |"
    echo "|---|---:|---|"
    for i in "${!PH_NAMES[@]}"; do echo "| ${PH_NAMES[$i]} | ${PH_SECS[$i]} | ${PH_STATUS[$i]} |"; done
    echo "| total | $(elapsed) | budget ${BUDGET} s |"
    echo
    echo "tests: $tests_line"
    echo
    echo '```'
    if [[ -f "$LOGDIR/gpu_results.txt" ]]; then cat "$LOGDIR/gpu_results.txt"; else echo "bench: no results"; fi
    echo '```'
  } > "$LOGDIR/gpu_check_table.md"
  echo "dated table: $LOGDIR/gpu_check_table.md"
  if [[ -f "$LOGDIR/gpu_results.txt" ]]; then
    cat "$LOGDIR/gpu_results.txt"
  else
    echo "bench: no results"
  fi
  return "$bad"
}

if [[ -n "$LOGDIR" ]]; then
  mkdir -p "$LOGDIR"
  main 2>&1 | tee "$LOGDIR/gpu_check.log"
  exit "${PIPESTATUS[0]}"
else
  main
fi
