"""Fork server for the kill -9 fault cases (tools/faults/matrix.py); run with sys.executable.

Imports torch and cudasnap once, then forks one training process per command.
Each child arms the test-only kill point (``faults.arm_kill``: cudasnap/_testing/faults.py
and csrc/test_hooks.h) *before* it touches the engine, trains
``steps`` steps with a snapshot and a flush after each, and is expected to
SIGKILL itself at the requested phase. It never restores (a fresh run).

Protocol: one JSON command per stdin line, single-line replies on stdout.
    {"cmd": "run", "dir", "job", "steps", "dim", "kill": "phase@n" | null, "out": PATH}
        -> "PID pid"; the child appends ``{"step": k, "digests": {...}}`` lines to
        PATH after each training step (before its snapshot), and ``{"done": true}``
        once every step is flushed.
    {"cmd": "reap", "pid": PID} -> "EXIT pid status"
    {"cmd": "quit"}
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository root

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

import cudasnap  # noqa: E402
import cudasnap.snapshotter  # noqa: E402,F401
from cudasnap._native import native  # noqa: E402
from cudasnap._testing import faults  # noqa: E402
from tools.faults.trainlib import Job  # noqa: E402

native()
torch.set_num_threads(1)
_warm = Job(dim=4)  # optimizer construction imports torch._dynamo lazily: do it once here
_warm.step()
del _warm


def out(line: str) -> None:
    data = (line + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def record(path: str, rec: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def child(c: dict) -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    if c.get("kill"):
        faults.arm_kill(c["kill"])  # before the engine's first kill point
    torch.set_num_threads(1)
    code = 0
    try:
        job = Job(dim=c["dim"])
        snap = cudasnap.Snapshotter(job.model, job.opt, directory=c["dir"], job=c["job"],
                                    extra=job.extra(), chunk_bytes=4096, copy_threads=1,
                                    flush_threads=2, keep=10)
        for k in range(c["steps"]):
            job.step()
            record(c["out"], {"step": k, "digests": job.digests()})
            snap.boundary(k)
            snap.wait()
            snap.flush()
        record(c["out"], {"done": True})
        snap.close(keep_arena=bool(c.get("keep_arena")))
    except BaseException:
        record(c["out"], {"error": traceback.format_exc()})
        code = 3
    os._exit(code)


def main() -> None:
    out("READY")
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "run":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                child(c)
            out(f"PID {pid}")
        elif c["cmd"] == "reap":
            _, status = os.waitpid(int(c["pid"]), 0)
            out(f"EXIT {c['pid']} {status}")
        elif c["cmd"] == "quit":
            break


if __name__ == "__main__":
    main()
