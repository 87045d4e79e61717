"""A training process for the Snapshotter end-to-end tests (run with sys.executable).

    train_job.py ref    --steps N --out ref.npz
    train_job.py crash  --steps N --crash-after K --dir D --job J [--flush-every F]
    train_job.py resume --steps N --dir D --job J --out out.npz

``crash`` snapshots every step (flushing every F steps), and after step K's
snapshot is COMPLETE kills itself with SIGKILL: no close(), no atexit, no
finally blocks. ``resume`` is a fresh process with a freshly built model and
optimizer: restore_latest(), then training to the end. It prints one JSON line
``{"start": ..., "restore": ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository root

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from tools.faults.trainlib import Job  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["ref", "crash", "resume"])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--crash-after", type=int, default=-1)
    ap.add_argument("--flush-every", type=int, default=0)
    ap.add_argument("--dir")
    ap.add_argument("--job")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    job = Job(dim=a.dim)
    if a.mode == "ref":
        for _ in range(a.steps):
            job.step()
        np.savez(a.out, **job.arrays())
        return
    import cudasnap

    snap = cudasnap.Snapshotter(job.model, job.opt, directory=a.dir, job=a.job, extra=job.extra(),
                                copy_threads=1)
    start = snap.restore_latest()
    print(json.dumps({"start": start, "restore": snap.stats()["restore"]}), flush=True)
    for step in range(start, a.steps):
        job.step()
        snap.boundary(step)
        if a.flush_every and step % a.flush_every == a.flush_every - 1:
            snap.flush()
        if step == a.crash_after:
            snap.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    snap.wait()
    np.savez(a.out, **job.arrays())
    snap.close()


if __name__ == "__main__":
    main()
