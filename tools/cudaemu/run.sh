#!/usr/bin/env bash
# Runs a command under the emulated CUDA runtime (tools/cudaemu), building it first.
#   tools/cudaemu/run.sh .venv/bin/python -m pytest tests/cuda_emu
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
LIB="$("$PY" "$ROOT/tools/cudaemu/build.py")"
DIR="$(dirname "$LIB")"
export LD_PRELOAD="$LIB${LD_PRELOAD:+:$LD_PRELOAD}"
export LD_LIBRARY_PATH="$DIR/driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDASNAP_EMULATED_CUDA=1
exec "$@"
