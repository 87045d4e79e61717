#!/usr/bin/env bash
# The one command for a lent GPU machine: build the CUDA backend, run the GPU tests,
# run bench/gpu_bench.py, print a table LAST and, as the very last line,
# "gpu_check: PASS (...)" or "gpu_check: FAIL (...)" (in every mode, also when the script
# stops early). Runs from any directory (cd's to the repo root), needs no network and no
# .venv: it uses the machine's own python3 + torch.
#
#   bash bench/gpu_check.sh [--budget S] [--quick] [--emulated] [--no-build] [--no-tests]
#                           [--no-bench] [--dry-run]
#
# Phases (each timestamped; with $OUT set, everything is teed to $OUT/gpu_check.log and
# build.log, pytest.log, gpu_tests.xml, gpu_results.json, gpu_results.txt land there):
#   detect   nvidia-smi / /dev/nvidia*, then torch.cuda in $PY; no GPU: prints
#            "skipped: no CUDA device (...)" and exits 0 before anything expensive
#   env      python, torch, nvcc, cmake, driver, PCIe link, clocks, /dev/shm, disk
#   build    CUDASNAP_REQUIRE_CUDA=1 $PY setup.py build_ext --inplace (build/gpu-cmake),
#            against whatever python3 + torch the machine has (2.6 to 2.15)
#   preflight $PY bench/gpu_bench.py --preflight (<= 45 s): a ~19 MB Snapshotter on the
#            GPU; waits for its staging arena (made in the background), one snapshot must
#            complete, flush and restore bit for bit, and the arena be page-locked (shared
#            and registered, or the fallback reason is printed). Its "fact" lines (register
#            ok / refused and why, /dev/shm size and free, MADV_POPULATE_WRITE, torch /
#            CUDA / driver versions, real or emulated) go into the table.
#   tests    $PY -m pytest -m gpu on the test files that hold GPU tests
#   bench    $PY bench/gpu_bench.py --budget <see below>; a PARTIAL result (its watchdog
#            stopped it) is a warning, not a failure
#   summary  phase table, facts, pytest's summary line, the bench table; also written,
#            dated, to $LOGDIR/gpu_check_table.md (for bench/RESULTS.md; the CI artifact)
#
# Time: --budget S wall seconds (default 540; --quick and --emulated: 480). Each phase has
# a limit from what is left: build min(300, left - 255) (at least 60), preflight 45,
# tests left - 75 within [150, 240 quick | 300], bench left - 60 within [60, 150 quick |
# 420 | 90 emulated]; the bench's own watchdog ends it by its limit + 45 s. The run ends by
# S + 45 s at worst (--quick: 525 s, under the 10 minutes of a lent machine), usually much
# sooner. --quick: bench smoke sizes.
#
# --emulated: the same script end to end without a GPU, under the emulated CUDA runtime
#   (tools/cudaemu): build (as `make build`), the emulator (tools/cudaemu/build.py),
#   preflight, tests = the emulated lane (tests/cuda_emu) instead of the GPU tests, bench
#   --emulated (smoke sizes, no kernels). Its figures are NOT GPU figures: the table says
#   so and nothing from it goes into bench/RESULTS.md.
# --dry-run: print the plan (phase limits) and the GPU detection result, run nothing.
# Environment: PYTHON (interpreter to use), CUDASNAP_CUDA_ARCHS (default 90), CUDA_HOME;
#   CUDASNAP_GPU_CHECK_FAKE=1 checks this script itself without a GPU (detection passes,
#   preflight and bench on the CPU backend; combine with --no-build to leave the built
#   extension alone).
# Exit: 0 when every phase that ran succeeded (missed bench targets are measurements, not
# failures: see the table; a PARTIAL bench is a warning) or when there is no GPU; 1
# otherwise; 2 for a bad argument.
# `source bench/gpu_check.sh` defines the functions (budget arithmetic: tests/
# test_gpu_check_script.py) and runs nothing.

# ------------------------------------------------------------------ phase limits
PREFLIGHT_S=45          # real GPU
PREFLIGHT_FAKE_S=120    # faked detection (CPU backend, maybe a loaded machine)
PREFLIGHT_EMU_S=90      # under the emulator (2-core CI machines)
TESTS_FLOOR_S=150       # ~20 GPU tests, ~9 of them fresh processes that init CUDA
BENCH_FLOOR_S=60
BENCH_GRACE_S=45        # the bench's hard watchdog fires 30 s after its budget; kill at 45
BUILD_MAX_S=300

# default_budget QUICK EMULATED
default_budget() {
  if (( $1 || $2 )); then echo 480; else echo 540; fi
}
clamp() {  # value lo hi
  local v=$1
  (( v < $2 )) && v=$2
  (( v > $3 )) && v=$3
  echo "$v"
}
# build_timeout LEFT: what is left after it must still hold preflight + tests + bench floors
build_timeout() {
  clamp $(( $1 - PREFLIGHT_S - TESTS_FLOOR_S - BENCH_FLOOR_S )) 60 "$BUILD_MAX_S"
}
# tests_timeout LEFT QUICK: the tests get at least TESTS_FLOOR_S whatever the build took
tests_timeout() {
  local cap=300
  (( $2 )) && cap=240
  clamp $(( $1 - BENCH_FLOOR_S - 15 )) "$TESTS_FLOOR_S" "$cap"
}
# bench_budget LEFT QUICK EMULATED: the bench's --budget (its process ends by + BENCH_GRACE_S)
bench_budget() {
  local cap=420
  (( $2 )) && cap=150
  (( $3 )) && cap=90
  clamp $(( $1 - BENCH_GRACE_S - 15 )) "$BENCH_FLOOR_S" "$cap"
}
# worst_case BUDGET: the latest the run can end if every phase runs to its limit
worst_case() { echo $(( $1 + BENCH_GRACE_S )); }

# phase_is_bad STATUS: failures count against PASS; "warning: ..." and "no GPU" do not
phase_is_bad() {
  case "$1" in
    ok|warning*|"no GPU") return 1 ;;
    *) return 0 ;;
  esac
}

# ------------------------------------------------------------------ the run
gpu_check_main() {
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  REPO=$(pwd)
  T0=$(date +%s)
  BUDGET=""
  QUICK=0 DRY=0 EMU=0 DO_BUILD=1 DO_TESTS=1 DO_BENCH=1
  FINAL="" CUR_PHASE=startup MODE_LINE="" CHILD="" TAILER=""
  FAKE=0
  [[ "${CUDASNAP_GPU_CHECK_FAKE:-}" == 1 ]] && FAKE=1
  trap 'on_exit' EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  trap 'exit 129' HUP
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --budget) BUDGET=${2:-}; [[ -n "$BUDGET" ]] || usage_error "--budget needs seconds"; shift 2 ;;
      --budget=*) BUDGET=${1#*=}; shift ;;
      --quick) QUICK=1; shift ;;
      --emulated) EMU=1; shift ;;
      --dry-run) DRY=1; shift ;;
      --no-build) DO_BUILD=0; shift ;;
      --no-tests) DO_TESTS=0; shift ;;
      --no-bench) DO_BENCH=0; shift ;;
      -h|--help) FINAL=-; sed -n '2,/^# test_gpu_check_script/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) usage_error "unknown argument: $1 (try --help)" ;;
    esac
  done
  if [[ -z "$BUDGET" ]]; then BUDGET=$(default_budget "$QUICK" "$EMU"); fi
  [[ "$BUDGET" =~ ^[0-9]+$ ]] || usage_error "--budget must be whole seconds"
  if (( EMU && FAKE )); then usage_error "--emulated and CUDASNAP_GPU_CHECK_FAKE=1 exclude each other"; fi

  export PYTHONUNBUFFERED=1
  export PYTHONDONTWRITEBYTECODE=1
  PH_NAMES=() PH_STATUS=() PH_SECS=() FACTS=()
  PH_T=0
  PY=$(pick_python)
  export PYTHON=$PY  # tools/cudaemu/run.sh builds the emulator with it
  RUN=("$PY")        # how Python runs after the build (under the emulator: run.sh first)
  SKIP_WHY="" GPU_LINE=""
  GPU_TEST_FILES=$(grep -rl --include='test_*.py' --exclude-dir=cuda_emu 'mark\.gpu' tests 2>/dev/null | sort | tr '\n' ' ' || true)
  BUILD_DIR="$REPO/build/gpu-cmake"
  ARCHS=${CUDASNAP_CUDA_ARCHS:-90}
  if (( EMU )); then
    MODE_LINE="EMULATED (tools/cudaemu, no GPU): these are NOT GPU figures; nothing here goes into bench/RESULTS.md"
  elif (( FAKE )); then
    MODE_LINE="FAKE (CUDASNAP_GPU_CHECK_FAKE=1: CPU backend, checks this script only)"
  else
    MODE_LINE="real GPU"
  fi

  if (( DRY )); then
    dry_run
    FINAL="gpu_check: PASS (dry run: nothing was built or run)"
    exit 0
  fi

  LOGDIR=${OUT:-}
  if [[ -n "$LOGDIR" ]]; then
    mkdir -p "$LOGDIR"
    # tee ignores TERM/INT: the FAIL line of an interrupted run still reaches the log
    exec > >(trap '' TERM INT HUP; exec tee -a "$LOGDIR/gpu_check.log") 2>&1
    TEE_PID=$!
  fi
  main_phases  # errexit stays on inside (a call in `||` would turn it off); sets FINAL
  exit 0
}

usage_error() {
  echo "gpu_check.sh: $1" >&2
  FINAL="gpu_check: FAIL (bad arguments: $1)"
  exit 2
}

on_exit() {
  local rc=$? i
  trap - EXIT TERM INT HUP
  if [[ -n "${CHILD:-}" ]] && kill -0 "$CHILD" 2>/dev/null; then  # stopped mid-phase
    kill -TERM "$CHILD" 2>/dev/null || true
    for i in $(seq 100); do kill -0 "$CHILD" 2>/dev/null || break; sleep 0.1; done
    # (no `wait` here: in this trap, bash can hang waiting for a job already reaped)
    for i in $(seq 20); do kill -0 "${TAILER:-0}" 2>/dev/null || break; sleep 0.1; done
  fi
  if [[ "$FINAL" != - ]]; then
    if [[ -z "$FINAL" ]]; then
      if (( rc == 0 )); then
        FINAL="gpu_check: PASS"
      else
        FINAL="gpu_check: FAIL (stopped with exit code $rc in phase $CUR_PHASE after $(elapsed) s)"
      fi
    fi
    echo "$FINAL"
  fi
  if [[ -n "${TEE_PID:-}" ]]; then  # let tee write the last line before the shell is gone
    exec >&- 2>&-
    for i in $(seq 50); do kill -0 "$TEE_PID" 2>/dev/null || break; sleep 0.1; done
  fi
  exit "$rc"
}

# run_logged LOG SHOW T CMD...: CMD under `timeout T`, its output saved to LOG and shown
# as it comes (SHOW: plain, indent or quiet); returns CMD's status. CMD runs in the
# background and this shell waits for it, so a TERM/INT to the script is handled at once:
# on_exit hands it to CMD (timeout passes it on to CMD's process group).
run_logged() {
  local logf=$1 show=$2 t=$3 rc=0
  shift 3
  : > "$logf"
  timeout -k 10 "$t" "$@" >"$logf" 2>&1 &
  CHILD=$!
  case "$show" in
    plain) tail -n +1 -s 0.2 -f --pid="$CHILD" "$logf" & TAILER=$! ;;
    indent) tail -n +1 -s 0.2 -f --pid="$CHILD" "$logf" | sed 's/^/   /' & TAILER=$! ;;
  esac
  wait "$CHILD" || rc=$?
  CHILD=""
  if [[ -n "${TAILER:-}" ]]; then wait "$TAILER" 2>/dev/null || true; TAILER=""; fi
  return "$rc"
}

elapsed() { echo $(( $(date +%s) - ${T0:-$(date +%s)} )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
log() { printf '[%s +%4ss] %s\n' "$(date -u +%H:%M:%S)" "$(elapsed)" "$*"; }
phase() { CUR_PHASE=$1; PH_T=$(date +%s); echo; log "==> phase $1"; }
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
  if (( FAKE )); then
    GPU_LINE="none (CUDASNAP_GPU_CHECK_FAKE=1: checking the script; bench --cpu-smoke)"
    return 0
  fi
  if (( EMU )); then  # the device comes from the emulator (built in its own phase)
    out=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")' 2>&1 | tail -n1) || true
    if [[ ! -f tools/cudaemu/build.py ]]; then
      SKIP_WHY="--emulated: tools/cudaemu/build.py is missing"; return 2
    fi
    if [[ ! "$out" =~ ^[^\ ]+\ [0-9] ]]; then
      SKIP_WHY="--emulated needs a CUDA build of torch in $PY (got: ${out:-nothing})"; return 2
    fi
    GPU_LINE="EMULATED (tools/cudaemu, torch $out): no GPU"
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

build_cmd() {  # the build command line, for the log and --dry-run
  if (( EMU )); then
    echo "CUDASNAP_CUDA_ARCHS=$ARCHS $PY setup.py -q build_ext --inplace (as make build)"
  else
    echo "CUDASNAP_REQUIRE_CUDA=1 CUDASNAP_CUDA_ARCHS=$ARCHS CUDASNAP_BUILD_DIR=$BUILD_DIR $PY setup.py build_ext --inplace"
  fi
}
tests_what() {
  if (( EMU )); then echo "tools/cudaemu/run.sh $PY -m pytest -q tests/cuda_emu (the emulated CUDA lane)"
  else echo "$PY -m pytest -m gpu -q -rfEs $GPU_TEST_FILES"; fi
}

dry_run() {
  local rc=0 l
  echo "gpu_check.sh --dry-run (budget ${BUDGET} s; nothing is built or run)"
  echo "  mode:   $MODE_LINE"
  echo "  repo:   $REPO"
  echo "  python: $PY"
  echo "  logs:   ${OUT:-<a fresh /tmp/cudasnap-gpu-check.* directory>}"
  l=$(( BUDGET - 10 ))
  if (( DO_BUILD )); then echo "  build:  $(build_cmd) (timeout <= $(build_timeout "$l") s)"
  else echo "  build:  skipped (--no-build)"; fi
  (( EMU )) && echo "  emulator: $PY tools/cudaemu/build.py; the phases below run under tools/cudaemu/run.sh"
  echo "  preflight: $PY bench/gpu_bench.py --preflight: arena awaited, a snapshot completes, flushes, restores bit for bit; page-locked or the fallback reason; facts (<= $(preflight_limit) s)"
  (( DO_TESTS )) && echo "  tests:  $(tests_what) (timeout >= ${TESTS_FLOOR_S} s, <= $(tests_timeout 100000 "$QUICK") s)"
  (( DO_BENCH )) && echo "  bench:  $PY bench/gpu_bench.py --budget <left - 60, within ${BENCH_FLOOR_S}..$(bench_budget 100000 "$QUICK" "$EMU")>$(bench_flags) (PARTIAL: a warning)"
  echo "  worst case: $(worst_case "$BUDGET") s"
  detect_gpu >/dev/null || rc=$?
  case $rc in
    0) echo "  detect: GPU found: $GPU_LINE" ;;
    1) echo "  detect: skipped: no CUDA device ($SKIP_WHY)" ;;
    *) echo "  detect: ERROR: $SKIP_WHY" ;;
  esac
}

bench_flags() {  # the bench's mode flags (leading space), before any time-based switch
  if (( EMU )); then echo " --emulated"
  elif (( FAKE )); then echo "$( (( QUICK )) && echo ' --quick') --cpu-smoke"
  elif (( QUICK )); then echo " --quick"
  fi
}

preflight_limit() {
  if (( FAKE )); then echo "$PREFLIGHT_FAKE_S"; elif (( EMU )); then echo "$PREFLIGHT_EMU_S"; else echo "$PREFLIGHT_S"; fi
}

main_phases() {
  local rc=0 t
  log "cudasnap gpu_check: repo $REPO, python $PY, budget ${BUDGET} s$( (( QUICK )) && echo ', --quick')$( (( EMU )) && echo ', --emulated')"
  phase detect
  detect_gpu || rc=$?
  if (( rc == 1 )); then
    phase_end detect "no GPU"
    echo "skipped: no CUDA device ($SKIP_WHY)"
    FINAL="gpu_check: PASS (skipped: no CUDA device, nothing was checked: $SKIP_WHY)"
    return 0
  elif (( rc != 0 )); then
    phase_end detect FAILED
    echo "ERROR: $SKIP_WHY"
    FINAL="gpu_check: FAIL (detect: $SKIP_WHY)"
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
    t=$(build_timeout "$(left)")
    log "$(build_cmd) (timeout ${t} s, log $LOGDIR/build.log)"
    rc=0
    if (( EMU )); then  # the tree's own build (build/cmake), as `make build` does it
      run_logged "$LOGDIR/build.log" quiet "$t" env CUDASNAP_CUDA_ARCHS="$ARCHS" \
        "$PY" setup.py -q build_ext --inplace || rc=$?
    else
      run_logged "$LOGDIR/build.log" quiet "$t" env CUDASNAP_REQUIRE_CUDA=1 \
        CUDASNAP_CUDA_ARCHS="$ARCHS" CUDASNAP_BUILD_DIR="$BUILD_DIR" \
        "$PY" setup.py build_ext --inplace || rc=$?
    fi
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

  if (( EMU )) && (( build_ok )); then
    phase emulator
    rc=0
    local lib
    lib=$(timeout -k 5 300 "$PY" tools/cudaemu/build.py 2>"$LOGDIR/emulator.log") || rc=$?
    if (( rc == 0 )) && [[ -f "$lib" ]]; then
      RUN=(tools/cudaemu/run.sh "$PY")
      local probe
      probe=$(timeout -k 5 120 "${RUN[@]}" -c "$PROBE" 2>>"$LOGDIR/emulator.log" | tail -n1) || true
      log "emulator: $lib; torch under it: ${probe:-no output}"
      if [[ "$probe" == GPU* ]]; then
        GPU_LINE="EMULATED: ${probe#GPU } (tools/cudaemu; no GPU)"
        phase_end emulator ok
      else
        build_ok=0
        phase_end emulator "FAILED (torch sees no device under it: ${probe:-no output})"
      fi
    else
      build_ok=0
      tail -n 30 "$LOGDIR/emulator.log" | sed 's/^/   | /'
      phase_end emulator "FAILED rc=$rc"
    fi
  fi

  if (( build_ok )); then
    phase preflight
    local dev=cuda pt
    pt=$(preflight_limit)
    (( FAKE )) && dev=cpu
    log "${RUN[*]} bench/gpu_bench.py --preflight --preflight-device $dev (timeout $pt s)"
    rc=0
    run_logged "$LOGDIR/preflight.log" indent "$pt" \
      "${RUN[@]}" bench/gpu_bench.py --preflight --preflight-device "$dev" || rc=$?
    local line
    while IFS= read -r line; do FACTS+=("${line#fact }"); done < <(grep -E '^fact ' "$LOGDIR/preflight.log" || true)
    if (( rc == 0 )); then phase_end preflight ok
    else phase_end preflight "FAILED rc=$rc$( (( rc == 124 )) && echo ' (timed out)')"; fi
  fi

  local tests_line="(not run)"
  if (( DO_TESTS )) && (( build_ok )); then
    phase tests
    t=$(tests_timeout "$(left)" "$QUICK")
    local topt=()
    "$PY" -c 'import pytest_timeout' >/dev/null 2>&1 && topt=(--timeout=180)
    local targets=()
    if (( EMU )); then
      targets=(tests/cuda_emu)
    else
      # shellcheck disable=SC2206  # the file list is split on purpose
      targets=(-m gpu $GPU_TEST_FILES)
    fi
    log "${RUN[*]} -m pytest ${targets[*]} (timeout ${t} s)"
    rc=0
    run_logged "$LOGDIR/pytest.log" plain "$t" "${RUN[@]}" -m pytest -q -rfEs -p no:cacheprovider \
      --junitxml="$LOGDIR/gpu_tests.xml" ${topt[@]+"${topt[@]}"} "${targets[@]}" || rc=$?
    tests_line=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$LOGDIR/pytest.log" | tail -n1 || true)
    [[ -n "$tests_line" ]] || tests_line="(no summary line; rc $rc)"
    (( rc == 124 )) && tests_line="TIMED OUT after ${t} s; last: $tests_line"
    if (( rc == 0 )); then phase_end tests ok; else phase_end tests "FAILED rc=$rc"; fi
  elif (( DO_TESTS )); then
    PH_NAMES+=(tests) PH_STATUS+=("not run (build failed)") PH_SECS+=(0)
  fi

  if (( DO_BENCH )) && (( build_ok )); then
    phase bench
    t=$(bench_budget "$(left)" "$QUICK" "$EMU")
    local q=()
    read -r -a q <<<"$(bench_flags)"
    if (( t < 150 )) && (( ! QUICK )) && (( ! EMU )) && (( ! FAKE )); then
      log "only ${t} s left: bench runs with --quick"; q=(--quick)
    fi
    log "${RUN[*]} bench/gpu_bench.py --budget $t ${q[*]} --out $LOGDIR"
    rc=0
    run_logged "$LOGDIR/bench.log" plain $(( t + BENCH_GRACE_S - 10 )) \
      "${RUN[@]}" bench/gpu_bench.py --budget "$t" ${q[@]+"${q[@]}"} --out "$LOGDIR" || rc=$?
    case $rc in
      0) phase_end bench ok ;;
      3) phase_end bench "warning: PARTIAL (its watchdog stopped it at ${t} s; the table has what it measured)" ;;
      *) phase_end bench "FAILED rc=$rc" ;;
    esac
  elif (( DO_BENCH )); then
    PH_NAMES+=(bench) PH_STATUS+=("not run (build failed)") PH_SECS+=(0)
  fi
  CUR_PHASE=summary
  summary "$tests_line"
}

summary() {  # tests_line
  local tests_line=$1 i bad=0 failed=() warned=() f
  echo
  echo "================ cudasnap gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ================"
  echo "mode: $MODE_LINE"
  echo "GPU: $GPU_LINE"
  for i in "${!PH_NAMES[@]}"; do
    printf '  %-9s %6ss  %s\n' "${PH_NAMES[$i]}" "${PH_SECS[$i]}" "${PH_STATUS[$i]}"
    if phase_is_bad "${PH_STATUS[$i]}"; then bad=1; failed+=("${PH_NAMES[$i]}"); fi
    [[ "${PH_STATUS[$i]}" == warning* ]] && warned+=("${PH_NAMES[$i]} ${PH_STATUS[$i]#warning: }")
  done
  printf '  %-9s %6ss  %s\n' total "$(elapsed)" "(budget ${BUDGET} s)"
  echo "facts:"
  if (( ${#FACTS[@]} )); then for f in "${FACTS[@]}"; do echo "  $f"; done
  else echo "  (none: the preflight did not run)"; fi
  echo "tests: $tests_line"
  {
    if (( EMU )); then
      echo "### gpu_check $(date -u +%Y-%m-%d) ($(date -u +%H:%M) UTC), --emulated: NOT a GPU run"
      echo
      echo "**$MODE_LINE.**"
    else
      echo "### gpu_check $(date -u +%Y-%m-%d) ($(date -u +%H:%M) UTC)$( (( QUICK )) && echo ', --quick')"
      echo
      echo "mode: $MODE_LINE"
    fi
    echo
    echo "GPU: $GPU_LINE"
    echo
    echo "| phase | seconds | status |"
    echo "|---|---:|---|"
    for i in "${!PH_NAMES[@]}"; do echo "| ${PH_NAMES[$i]} | ${PH_SECS[$i]} | ${PH_STATUS[$i]} |"; done
    echo "| total | $(elapsed) | budget ${BUDGET} s |"
    echo
    echo "| fact | value |"
    echo "|---|---|"
    for f in ${FACTS[@]+"${FACTS[@]}"}; do echo "| ${f%%: *} | ${f#*: } |"; done
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
  local what="real GPU"
  (( EMU )) && what="EMULATED, not a GPU result"
  (( FAKE )) && what="FAKE detection, CPU backend"
  (( QUICK )) && what+=", --quick"
  local warn=""
  if (( ${#warned[@]} )); then warn="; warning: ${warned[*]}"; fi
  if (( bad )); then
    FINAL="gpu_check: FAIL (failed: ${failed[*]}; $what; $(elapsed) s of ${BUDGET} s$warn)"
  else
    FINAL="gpu_check: PASS ($what; $(elapsed) s of ${BUDGET} s$warn)"
  fi
  return "$bad"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  gpu_check_main "$@"
fi
