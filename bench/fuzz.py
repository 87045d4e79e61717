"""Long fuzzing run of tests/format/test_fuzz.py (hypothesis): manifests, manifest files, arena
files and host-state decoding.

    .venv/bin/python bench/fuzz.py [--examples N] [--seed S] [-k EXPR]

Runs every property of tests/format/test_fuzz.py with N examples each (default 5000; the
suite uses 300, derandomized), random exploration (a seed is printed, so a failure can
be replayed with --seed), and prints hypothesis's per-property statistics: how many
inputs were refused with which SnapshotError, how many reached the data reader or a
valid arena slot. Exit status: pytest's (0 = no property broken).
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset of properties)")
    a = ap.parse_args()
    env = {**os.environ, "CUDASNAP_FUZZ_EXAMPLES": str(max(a.examples, 501))}
    cmd = [sys.executable, "-m", "pytest", str(REPO / "tests" / "format" / "test_fuzz.py"), "-q",
           "-p", "no:cacheprovider", "--hypothesis-show-statistics",
           f"--hypothesis-seed={a.seed}"]
    if a.k:
        cmd += ["-k", a.k]
    print(f"fuzz: {a.examples} examples per property, seed {a.seed}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    print(f"fuzz: exit {rc} after {time.perf_counter() - t0:.0f} s (replay: --seed {a.seed})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
