"""``cudasnap demo --json``: a supervised run survives a fault and ends bitwise equal to an
uninterrupted one, replaying at most one step (real processes, small model)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASES = [
    # fault, exit of the first attempt, steps it may resume at (failure at step 6)
    ("kill", "killed by SIGKILL", {5, 6}),       # dies inside step 6: 4 or 5 COMPLETE
    # Xid 79 at boundary 6, delivered asynchronously (as NVML does): training goes on
    # while the process flushes, so a later step may be the newest COMPLETE one.
    ("xid", "exit code 76 (GPU fault)", set(range(6, 13))),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,exit_text,resume", CASES, ids=[c[0] for c in CASES])
def test_demo_json_bitwise_identical(snap_env, fault, exit_text, resume):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"CUDASNAP_JOB": snap_env.job, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    work = snap_env.tmp / "demo"
    p = subprocess.run([sys.executable, "-m", "cudasnap", "demo", "--json", "--steps", "12",
                        "--fail-at", "6", "--hidden", "128", "--layers", "2", "--device", "cpu",
                        "--fault", fault, "--workdir", str(work)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["bitwise_identical"] is True, r
    assert r["replayed_steps"] <= 1, r
    assert r["fault"] == fault and r["failure_step"] == 6
    assert r["exit"] == exit_text, r
    assert r["resumed_at"] in resume, r
    assert r["restore_source"] in ("shm", "disk")
    assert r["flush_seconds"] is not None  # a snapshot reached the disk
    assert "result            : PASS" in p.stdout
    # The step it resumed from reached the disk (the fault's flush, or the supervisor's flush
    # of the dead process's newest COMPLETE slot), and the fault's flush (the first record)
    # never wrote a step newer than the one resumed from.
    recs = [json.loads(ln) for ln in (work / "ckpt" / "flush-log.jsonl").read_text().splitlines()]
    assert r["resumed_at"] - 1 in {rec["step"] for rec in recs}, recs
    assert recs[0]["step"] <= r["resumed_at"] - 1, recs
    # ... and the resumed run's close() made its final step durable (flush_on_close).
    assert recs[-1]["step"] == 11, recs
