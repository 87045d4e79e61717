"""Fork server for the torn-state trials (tests/e2e/test_torn.py); run with sys.executable.

Importing torch costs seconds on the test machines, so this process imports
everything once and forks one training process per command (the way a
DataLoader forks its workers). Each forked process builds its own model,
optimizer and Snapshotter from scratch and runs as an ordinary training
process; the test kills it with SIGKILL, so nothing of its Python state
survives but what cudasnap put in /dev/shm and on disk.

Protocol: one JSON command per stdin line; replies are single lines on stdout.

    {"cmd": "run", "id": ID, "role": "reference"|"victim"|"resume", ...} -> "PID ID pid"
    {"cmd": "reap", "pid": PID}                                           -> "EXIT pid status"
    {"cmd": "quit"}

A forked process writes markers ``M ID KIND STEP JSON`` as it goes:
    REF k digests       reference: state after step k (k = -1: initial state)
    S k {copy_s}        victim/resume: boundary(k) returned (copy of k may still run)
    F k {}              about to flush;  f k {flush_s}: flush returned
    R start {digests, restore}   resume: restored (state before any further step)
    FINAL n digests     resume/reference: state after the last step
    IDLE n {}           victim: all steps done, waiting to be killed
    ERR 0 {traceback}
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The trials kill at every phase from step 0 on: the arena (~5 MB x 3 slots) is made
# at the first boundary, not by the background preparer (tests/core/test_arena_preparer.py).
os.environ.setdefault("CUDASNAP_ARENA_SYNC_MAX_BYTES", str(1 << 30))
sys.path.insert(0, str(HERE.parent.parent))

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401  (the Snapshotter imports it)

import cudasnap  # noqa: E402
import cudasnap.snapshotter  # noqa: E402,F401
from cudasnap._native import native  # noqa: E402
from tools.faults.trainlib import Job  # noqa: E402

native()
torch.set_num_threads(1)
# Warm up (optimizer construction imports torch._dynamo lazily: seconds), still
# single-threaded, so forking afterwards is safe.
_warm = Job(dim=4)
_warm.step()
del _warm


def out(line: str) -> None:
    data = (line + "\n").encode()
    while data:
        n = os.write(1, data)
        data = data[n:]


def mark(tid: int, kind: str, step: int, payload=None) -> None:
    out(f"M {tid} {kind} {step} {json.dumps(payload if payload is not None else {})}")


def reference(c: dict) -> None:
    job = Job(dim=c["dim"])
    mark(c["id"], "REF", -1, job.digests())
    for k in range(c["steps"]):
        job.step()
        mark(c["id"], "REF", k, job.digests())
    mark(c["id"], "FINAL", c["steps"] - 1, job.digests())


def train(c: dict, resume: bool) -> None:
    tid, steps, every = c["id"], c["steps"], c["flush_every"]
    job = Job(dim=c["dim"])
    snap = cudasnap.Snapshotter(job.model, job.opt, directory=c["dir"], job=c["job"],
                                extra=job.extra(), keep=c.get("keep", 3))
    start = snap.restore_latest()
    if resume:
        mark(tid, "R", start, {"digests": job.digests(), "restore": snap.stats()["restore"]})
    for k in range(start, steps):
        job.step()
        snap.boundary(k)
        mark(tid, "S", k, {"copy_s": snap.stats()["last_copy_seconds"]})
        if k % every == every - 1:
            mark(tid, "F", k)
            t0 = time.perf_counter()
            snap.flush()
            mark(tid, "f", k, {"flush_s": time.perf_counter() - t0})
    snap.wait()
    if not resume:
        # A victim is always killed: if the kill comes late, it finds the job idle here.
        mark(tid, "IDLE", steps - 1)
        time.sleep(3600)
    mark(tid, "FINAL", steps - 1, job.digests())
    snap.close()


def child(c: dict) -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    torch.set_num_threads(1)
    code = 0
    try:
        if c["role"] == "reference":
            reference(c)
        else:
            train(c, resume=c["role"] == "resume")
    except BaseException:
        mark(c["id"], "ERR", 0, {"traceback": traceback.format_exc()})
        code = 3
    os._exit(code)


def main() -> None:
    torch.set_num_threads(1)
    out("READY")
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "run":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                child(c)
            out(f"PID {c['id']} {pid}")
        elif c["cmd"] == "reap":
            _, status = os.waitpid(int(c["pid"]), 0)
            out(f"EXIT {c['pid']} {status}")
        elif c["cmd"] == "quit":
            break


if __name__ == "__main__":
    main()
