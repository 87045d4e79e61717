"""Runs tools/dist/ddp_train.py under torchrun and collects what the ranks wrote.

Used by tests/distributed/test_distributed.py and bench/distributed.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
JOB_SCRIPT = Path(__file__).with_name("ddp_train.py")
SHM = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))


@dataclass
class Run:
    """One torchrun invocation (all its restart attempts)."""

    rc: int
    log: str
    out: Path
    ckpt: Path
    job: str
    seconds: float
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)

    def state(self, rank: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"rank-{rank}.npz") as z:
            return {k: z[k] for k in z.files}

    def restored(self, rank: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"restored-rank-{rank}.npz") as z:
            return {k: z[k] for k in z.files}

    def step_state(self, rank: int, step: int) -> dict[str, np.ndarray]:
        with np.load(self.out / "steps" / f"rank-{rank}-step-{step}.npz") as z:
            return {k: z[k] for k in z.files}

    def kill(self) -> dict[str, Any] | None:
        p = self.out / "kill.json"
        return json.loads(p.read_text()) if p.exists() else None

    def events(self) -> list[dict[str, Any]]:
        from cudasnap.distributed.events import read_events

        return read_events(self.ckpt)


def new_job() -> str:
    return f"dist-{uuid.uuid4().hex[:10]}"


def arena_path(job: str, rank: int) -> Path:
    return SHM / f"cudasnap-{job}-r{rank}.arena"


def cleanup_arenas(job: str) -> None:
    for p in SHM.glob(f"cudasnap-{job}-*"):
        p.unlink(missing_ok=True)


def run(base: Path, *, nproc: int = 4, max_restarts: int = 1, env: dict[str, str] | None = None,
        job: str | None = None, out: str = "out", ckpt: str = "ckpt",
        timeout: float = 240.0, script: Path = JOB_SCRIPT, prefix: list[str] | None = None) -> Run:
    """torchrun --standalone --nnodes=1 --nproc-per-node=NPROC --max-restarts=M ddp_train.py
    (``prefix``: a command that runs torchrun, e.g. in other namespaces; it ends with the
    torchrun command's arguments appended)."""
    import time

    base.mkdir(parents=True, exist_ok=True)
    store_dir = base / f"store-{uuid.uuid4().hex[:6]}"
    store_dir.mkdir()
    job = job or new_job()
    e = dict(os.environ)
    e.update({"CKPT": str(base / ckpt), "OUT": str(base / out), "STORE_DIR": str(store_dir),
              "CUDASNAP_JOB": job, "CUDASNAP_HEALTH": "1", "PYTHONPATH": str(REPO),
              "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    e.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.1", str(script)]
    cmd = (prefix or []) + cmd
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout)
        rc, log = p.returncode, p.stdout
    except subprocess.TimeoutExpired as ex:
        rc, log = -999, (ex.stdout or b"").decode(errors="replace") if isinstance(
            ex.stdout, bytes) else (ex.stdout or "")
    r = Run(rc=rc, log=log, out=base / out, ckpt=base / ckpt, job=job,
            seconds=time.monotonic() - t0)
    for rank in range(nproc):
        f = r.out / f"rank-{rank}.json"
        if f.exists():
            r.ranks[rank] = json.loads(f.read_text())
    return r


def log_tail(r: Run, n: int = 60) -> str:
    lines = [ln for ln in r.log.splitlines()
             if "FutureWarning" not in ln and "import pynvml" not in ln and "NVML" not in ln]
    return "\n".join(lines[-n:])
