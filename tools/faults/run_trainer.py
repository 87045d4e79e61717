"""A training process for tests/supervisor/test_run.py, tests/tools/test_cli.py and the
supervisor fault cases (tools/faults/supervisor.py).

Runs as a script (``python run_trainer.py ...``) or, much faster, forked from
the warm server in run_forkserver.py (``run_trainer.main(argv)``). The model,
optimizer, scheduler, data position and RNG use are tools.faults.trainlib.Job's;
the step is split here so a kill can land between its phases.

    --steps N --stats FILE [--out final.npz] [--ref]
    --kill-at K --kill-phase pre|mid|post_opt|post_boundary|post_wait|flush
    --stall-after N     after boundary(N) and wait(): idle (a fault is due)
    --block-after N     after boundary(N) and wait(): SIGTERM masked on the
                        main thread, then block in threading.Event().wait()
    --sleep-per-step S  a slow but live loop
    --flush-end         flush once after the last step
    --slow-flush S      every flush first sleeps S seconds (a big state, a slow disk)
    --exit-hard         os._exit(0) after the last step (no close: arena stays)
    --flush-at K        after boundary(K): a flush starts on a thread and stays in progress
                        (its write held, the slot leased) until boundary(K + --flush-steps)
                        is done: a long flush that training runs beside (bench/faults.py)
    --kill-after-flush  SIGKILL after the optimizer step of the first step begun once the
                        --flush-at flush has ended ("right after a long flush")
    --kill-after-close  SIGKILL right after close() (which flushes the final step)
    --no-spare-slot / --no-close-flush  Snapshotter(spare_slot=False / flush_on_close=False):
                        the behaviour before issue 14 items 1 / 2 (negative controls)
    --second-snapshotter  then a second Snapshotter (DIR-2, job JOB-2) with health on

Kill/stall/block/flush-at apply on the first attempt only (CUDASNAP_RESTART unset or 0).
Events are JSON lines appended to --stats (start, boundary, stalled, blocked, final,
flush_start, flush_done, kill), each with its wall-clock time ``t``.
The Snapshotter takes its directory/job/health settings from the environment
(CUDASNAP_DIR, CUDASNAP_JOB, CUDASNAP_HEALTH, ...), as under ``cudasnap run``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent.parent) not in sys.path:  # the repository root (run as a script)
    sys.path.insert(0, str(HERE.parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tools.faults.trainlib import Job  # noqa: E402

PHASES = ("pre", "mid", "post_opt", "post_boundary", "post_wait", "flush")


def emit(path: str, **rec) -> None:
    rec.setdefault("t", time.time())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(rec, default=str) + "\n").encode())
    finally:
        os.close(fd)


def train_step(job: Job, at) -> None:
    """tools.faults.trainlib.Job.step, with a callback between its phases."""
    i = job.data.pos % job.data.n_batches
    x = job.dataset[i * job.batch:(i + 1) * job.batch]
    noise = np.random.standard_normal(x.shape).astype(np.float32)
    x = x + 0.05 * torch.from_numpy(noise)
    scale = 1.0 + random.random()
    loss = (job.model(x) - x).pow(2).mean() * scale
    loss.backward()
    at("mid")
    job.opt.step()
    job.opt.zero_grad(set_to_none=True)
    job.sched.step()
    job.data.pos += 1
    at("post_opt")


def warm_up() -> None:
    """Imports what the first optimizer step imports lazily (seconds), single-threaded."""
    job = Job(dim=4)
    train_step(job, lambda _: None)


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--out")
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-phase", choices=PHASES, default="mid")
    ap.add_argument("--stall-after", type=int, default=-1)
    ap.add_argument("--block-after", type=int, default=-1)
    ap.add_argument("--sleep-per-step", type=float, default=0.0)
    ap.add_argument("--flush-end", action="store_true")
    ap.add_argument("--exit-hard", action="store_true")
    ap.add_argument("--slow-flush", type=float, default=0.0,
                    help="every flush first sleeps this long (a big state, a slow disk)")
    ap.add_argument("--flush-at", type=int, default=-1,
                    help="start a flush after boundary(K), held until boundary(K + --flush-steps)")
    ap.add_argument("--flush-steps", type=int, default=3)
    ap.add_argument("--kill-after-flush", action="store_true")
    ap.add_argument("--kill-after-close", action="store_true")
    ap.add_argument("--no-spare-slot", action="store_true")
    ap.add_argument("--no-close-flush", action="store_true")
    ap.add_argument("--second-snapshotter", action="store_true",
                    help="then a second Snapshotter (own directory and job) snapshots and flushes")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    attempt = int(os.environ.get("CUDASNAP_RESTART", "0") or 0)
    first = attempt == 0
    job = Job(dim=a.dim)
    if a.slow_flush:
        from cudasnap.format import paths
        from cudasnap.storage import posix

        real_write_slot = posix.write_slot

        def slow_write_slot(*args, **kw):
            time.sleep(a.slow_flush)
            return real_write_slot(*args, **kw)

        posix.write_slot = slow_write_slot
    held = threading.Event()  # set once boundary(flush_at + flush_steps) is done
    flusher: threading.Thread | None = None
    if first and a.flush_at >= 0:
        from cudasnap.storage import posix

        real_write = posix.write_slot

        def held_write_slot(*args, **kw):
            held.wait(120)  # (bounded: a run that never gets there still ends)
            return real_write(*args, **kw)

        posix.write_slot = held_write_slot
    snap = None
    start = 0
    if not a.ref:
        import cudasnap

        snap = cudasnap.Snapshotter(job.model, job.opt, extra=job.extra(), copy_threads=1,
                                    spare_slot=not a.no_spare_slot,
                                    flush_on_close=not a.no_close_flush)
        start = snap.restore_latest()
    emit(a.stats, ev="start", attempt=attempt, pid=os.getpid(), start=start,
         restore=snap.stats()["restore"] if snap else None,
         guard=snap.guard is not None if snap else False)

    def flush_then_record(step: int) -> None:
        emit(a.stats, ev="flush_done", step=step, flushed=str(snap.flush()))

    def at(phase: str, step: int) -> None:
        after_flush = (a.kill_after_flush and phase == "post_opt" and flusher is not None
                       and not flusher.is_alive())
        if first and (after_flush or (step == a.kill_at and phase == a.kill_phase)):
            emit(a.stats, ev="kill", step=step, phase=phase,
                 flushing=flusher is not None and flusher.is_alive())
            die()

    for step in range(start, a.steps):
        if snap is not None and snap.guard is not None and snap.guard.should_hang(step):
            emit(a.stats, ev="hang", step=step)
            time.sleep(60)  # injected hang: the watchdog must fire long before this ends
            emit(a.stats, ev="hang_expired", step=step)
            return 5
        at("pre", step)
        train_step(job, lambda ph, s=step: at(ph, s))
        if snap is not None:
            snap.boundary(step)
            emit(a.stats, ev="boundary", step=step)
            at("post_boundary", step)
            if first and step == a.flush_at:
                snap.wait()
                flusher = threading.Thread(target=flush_then_record, args=(step,), daemon=True)
                emit(a.stats, ev="flush_start", step=step)
                flusher.start()
            if first and a.flush_at >= 0 and step == a.flush_at + a.flush_steps:
                snap.wait()
                held.set()
                if a.kill_after_flush:  # the kill comes right after the flush ends
                    flusher.join(120)
            if first and step == a.kill_at and a.kill_phase in ("post_wait", "flush"):
                snap.wait()
                if a.kill_phase == "flush":
                    from cudasnap.format import paths
                    from cudasnap.storage import posix

                    real = posix._write_file_durable

                    def killing_write(path, data, real=real, step=step):
                        if Path(path).name == paths.MANIFEST:  # data.bin written, not renamed
                            emit(a.stats, ev="kill", step=step, phase="flush")
                            die()
                        real(path, data)

                    posix._write_file_durable = killing_write
                    snap.flush()
                at("post_wait", step)
            if first and step in (a.stall_after, a.block_after):
                snap.wait()
                if step == a.stall_after:
                    emit(a.stats, ev="stalled", step=step)
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        time.sleep(0.05)
                    emit(a.stats, ev="stall_expired", step=step)
                    return 3
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                emit(a.stats, ev="blocked", step=step)
                threading.Event().wait(30)  # blocks in C; SIGTERM goes to another thread
                emit(a.stats, ev="block_expired", step=step)
                return 4
        if a.sleep_per_step:
            time.sleep(a.sleep_per_step)
    rec = {"ev": "final", "attempt": attempt, "start": start, "steps": a.steps}
    if snap is not None:
        snap.wait()
        if a.flush_end:
            rec["flushed"] = str(snap.flush())
    if a.out:
        np.savez(a.out, **job.arrays())
    if a.exit_hard:
        emit(a.stats, **rec)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if snap is not None:
        snap.close()  # (a triggered flush still running completes first)
        rec["stats"] = snap.stats()
        if snap.guard is not None:
            rec["triggers"] = [(h.trigger.kind, h.outcome) for h in snap.guard.history()]
    emit(a.stats, **rec)
    if first and a.kill_after_close:
        emit(a.stats, ev="kill", step=a.steps, phase="after_close")
        die()
    if a.second_snapshotter:
        import cudasnap

        two = cudasnap.Snapshotter(job.model, job.opt, directory=str(snap.directory) + "-2",
                                   job=snap.job + "-2", health=True, copy_threads=1)
        two.boundary(a.steps)
        emit(a.stats, ev="second", flushed=str(two.flush()), guard=two.guard is not None)
        two.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
