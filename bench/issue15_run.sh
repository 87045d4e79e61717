#!/usr/bin/env bash
# Issue 15's targets in ONE dated run on the CPU backend: every bench command that measures a
# target, one after the other, with the date, the commit and the load average logged around
# each, so bench/RESULTS.md can quote a single run (absolute times only mean something next to
# the baselines each script measures in the same process).
#
#   bash bench/issue15_run.sh [--quick] [--no-peers] [--out DIR]
#
# Steps (minutes on the 2-core VM, full / --quick):
#   crc       bench/crc_bench.py --repeats 11                                  target 3   0.5 / 0.2
#   boundary  bench/boundary_cpu.py --tensors 8,4000,40000 --boundaries 60 --repeats 2
#                                                                               target 2   4   / 1
#   first     bench/snapshot_cpu.py --first-boundary --sizes 1,4 --repeats 2   target 1   2.5 / 0.5
#   restore   bench/snapshot_cpu.py --sizes 0.5 --repeats 3 --shapes few,many --peers none
#                                                                               target 6a  1.5 / 0.5
#   flush     bench/jit_flush.py --direct --sizes 1 --repeats 3                 target 4   1.5 / 0.5
#   jit       bench/jit_flush.py --sizes 1 --repeats 2   (supervised: Xid, SIGTERM, kill -9)
#                                                                               target 4   6   / 2
#   demo      python -m cudasnap demo --json, 3 times                           target 6b  2   / 1
#   peers     bench/peers.py --sizes 1 --repeats 2                              peers      20  / 3
# Target 5 (snapshot_every=k, live JIT save) is tested in make test (tests/core/test_snapshot_every.py).
#
# Output: DIR (default build/issue15-<UTC date-time>) holds <step>.log for each step and
# run.log (timestamps, load, exit codes). Exit status: 0 when every step exited 0.
# Run it on a quiet machine: a second job on the same cores shows in every figure.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
QUICK=0 PEERS=1 OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --no-peers) PEERS=0; shift ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "issue15_run.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || { echo "issue15_run.sh: no interpreter at $PY (run make build, or set PYTHON)" >&2; exit 2; }
OUT=${OUT:-build/issue15-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Peer packages that are not in requirements (bench/peers.py says which it found).
[[ -d build/bench-peers ]] && export PYTHONPATH=$PYTHONPATH:$PWD/build/bench-peers

log() { printf '[%s] %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" | tee -a "$OUT/run.log"; }
FAILED=0
step() {  # step NAME command...
  local name=$1; shift
  log "start $name (load $(cut -d' ' -f1-3 /proc/loadavg)): $*"
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  log "end   $name rc=$rc in $((SECONDS - t0)) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
  (( rc == 0 )) || FAILED=1
}

log "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (dirty)'), $(nproc) cores, $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
if (( QUICK )); then
  step crc "$PY" bench/crc_bench.py --repeats 3
  step boundary "$PY" bench/boundary_cpu.py --tensors 8,4000 --boundaries 20
  step first "$PY" bench/snapshot_cpu.py --first-boundary --sizes 0.25 --repeats 1
  step restore "$PY" bench/snapshot_cpu.py --sizes 0.1 --repeats 1 --shapes few,many --peers none
  step flush "$PY" bench/jit_flush.py --direct --sizes 0.1 --repeats 1
  step jit "$PY" bench/jit_flush.py --quick
  step demo "$PY" -m cudasnap demo --json
  (( PEERS )) && step peers "$PY" bench/peers.py --quick --png ''
else
  step crc "$PY" bench/crc_bench.py --repeats 11
  step boundary "$PY" bench/boundary_cpu.py --tensors 8,4000,40000 --boundaries 60 --repeats 2
  step first "$PY" bench/snapshot_cpu.py --first-boundary --sizes 1,4 --repeats 2
  step restore "$PY" bench/snapshot_cpu.py --sizes 0.5 --repeats 3 --shapes few,many --peers none
  step flush "$PY" bench/jit_flush.py --direct --sizes 1 --repeats 3
  step jit "$PY" bench/jit_flush.py --sizes 1 --repeats 2
  for i in 1 2 3; do step "demo$i" "$PY" -m cudasnap demo --json; done
  (( PEERS )) && step peers "$PY" bench/peers.py --sizes 1 --repeats 2 --png ''
fi
log "done: logs in $OUT$( (( FAILED )) && echo ', SOME STEP FAILED (see rc= above)')"
exit $FAILED
