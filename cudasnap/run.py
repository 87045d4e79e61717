"""``cudasnap run -- python train.py ...``: a thin crash supervisor.

It starts the training command with cudasnap's guard enabled (health monitor,
signal handlers, watchdog: ``CUDASNAP_HEALTH=1``), the snapshot directory and
the arena name in the environment, and waits. When the child dies — any
signal, a non-zero exit, a GPU-lost exit — it flushes the newest COMPLETE
shared-memory slot the child left (so even a SIGKILL loses at most one step),
then restarts the command, up to ``--max-restarts`` times. The restarted
process resumes with ``restore_latest()`` (from shared memory when the slot is
there, else disk).

With torchrun, torchrun stays the engine: run ``torchrun --max-restarts=N
train.py`` with ``CUDASNAP_HEALTH=1`` exported; each restarted rank restores
from the shared-memory slot its predecessor left (see cudasnap.distributed).
``cudasnap run`` supervises single-process jobs (or one torchrun agent:
``cudasnap run -- torchrun ...`` flushes every rank's arena when the agent dies).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import store
from ._native import native
from .errors import SnapshotError

log = logging.getLogger("cudasnap.run")

EXIT_CODES = {75: "GPU lost", 76: "GPU fault", 77: "hang", 78: "preempted", 79: "peer failure"}


def job_for(directory: Path) -> str:
    """The arena name a Snapshotter derives for ``directory`` (see Snapshotter.job)."""
    return hashlib.sha1(os.path.realpath(directory).encode()).hexdigest()[:16]


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}" + (f" ({EXIT_CODES[rc]})" if rc in EXIT_CODES else "")


def flush_orphans(directory: Path, job: str, shm_dir: Path, threads: int = 4) -> list[dict[str, Any]]:
    """Flushes every COMPLETE slot of ``job``'s arenas that is newer than disk."""
    C = native()
    done = []
    on_disk = {s.step for s in store.list_snapshots(directory)}
    for path in sorted(shm_dir.glob(f"cudasnap-{job}-r*.arena")):
        try:
            arena = C.Arena.open(str(path), True)
        except SnapshotError as e:
            log.warning("cannot open arena %s: %s", path, e)
            continue
        slot = arena.newest_complete()
        if slot < 0:
            log.warning("arena %s holds no COMPLETE snapshot", path)
            continue
        step = arena.slot_info(slot)["step"]
        if step in on_disk:
            done.append({"arena": str(path), "step": step, "seconds": 0.0, "skipped": True})
            continue
        arena.lease(slot)
        try:
            t0 = time.perf_counter()
            target, st = store.write_slot(arena, slot, directory, threads=threads)
            done.append({"arena": str(path), "step": step, "seconds": time.perf_counter() - t0,
                         "bytes": st["bytes"], "path": str(target)})
            log.warning("flushed step %d left in %s to %s (%.2f s)", step, path, target,
                        time.perf_counter() - t0)
        finally:
            arena.release(slot)
    return done


def supervise(cmd: list[str], directory: Path, *, max_restarts: int = 3,
              shm_dir: Path | None = None, inject_first: str | None = None,
              watchdog_s: float | None = None, extra_env: dict[str, str] | None = None,
              report: list[dict[str, Any]] | None = None, auto: bool = False) -> int:
    """Runs ``cmd`` until it exits 0 or ``max_restarts`` restarts are used; returns its code."""
    if not cmd:
        raise SystemExit("cudasnap run: no command given (usage: cudasnap run [options] -- cmd ...)")
    directory = store.check_directory(directory)
    shm = Path(shm_dir or os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
    job = os.environ.get("CUDASNAP_JOB") or job_for(directory)
    attempt = 0
    child: subprocess.Popen[bytes] | None = None
    stop_requested = False
    stop_signal = signal.SIGTERM

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stop_requested, stop_signal
        stop_requested = True
        stop_signal = signal.Signals(signum)
        if child is not None and child.poll() is None:
            log.warning("forwarding %s to the training process", signal.Signals(signum).name)
            child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        while True:
            env = dict(os.environ)
            env.update({"CUDASNAP_HEALTH": "1", "CUDASNAP_DIR": str(directory),
                        "CUDASNAP_JOB": job, "CUDASNAP_SHM_DIR": str(shm),
                        "CUDASNAP_RESTART": str(attempt), "CUDASNAP_SUPERVISED": "1"})
            if watchdog_s:
                env["CUDASNAP_WATCHDOG_S"] = str(watchdog_s)
            if auto:
                env["CUDASNAP_AUTO"] = "1"
                autoload = str(Path(__file__).resolve().parent / "_autoload")
                env["PYTHONPATH"] = os.pathsep.join(
                    [autoload, str(Path(__file__).resolve().parent.parent)] +
                    ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            if inject_first and attempt == 0:
                env["CUDASNAP_INJECT"] = inject_first
            elif attempt > 0:
                env.pop("CUDASNAP_INJECT", None)
            env.update(extra_env or {})
            t_start = time.time()
            child = subprocess.Popen(cmd, env=env)
            if stop_requested and child.poll() is None:
                # The signal came before this child existed (or during the restart
                # gap): it must not run on as if nothing had been asked.
                log.warning("forwarding %s to the training process", stop_signal.name)
                child.send_signal(stop_signal)
            rc = child.wait()
            t_dead = time.time()
            entry: dict[str, Any] = {"attempt": attempt, "rc": rc, "started": t_start,
                                     "died": t_dead, "exit": describe_exit(rc)}
            if rc == 0:
                if report is not None:
                    report.append(entry)
                return 0
            log.warning("training process %s (attempt %d)", describe_exit(rc), attempt)
            entry["flushed"] = flush_orphans(directory, job, shm)
            entry["flush_done"] = time.time()
            if report is not None:
                report.append(entry)
            if stop_requested:
                log.warning("stop requested: not restarting")
                return rc if rc >= 0 else 128 - rc
            if attempt >= max_restarts:
                log.error("giving up after %d restart(s)", max_restarts)
                return rc if rc >= 0 else 128 - rc
            attempt += 1
            log.warning("restarting (restart %d of %d)", attempt, max_restarts)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cudasnap run", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.environ.get("CUDASNAP_DIR", "ckpt"),
                   help="snapshot directory (exported as CUDASNAP_DIR)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--watchdog", type=float, default=None, help="hang timeout in seconds")
    p.add_argument("--inject", default=None, help="fault injection for the first attempt")
    p.add_argument("--auto", action="store_true",
                   help="transparent mode for scripts without cudasnap code (no bitwise resume)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command ...")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cudasnap-run %(message)s")
    return supervise(cmd, Path(a.dir), max_restarts=a.max_restarts, inject_first=a.inject,
                     watchdog_s=a.watchdog, auto=a.auto)


if __name__ == "__main__":
    sys.exit(main())
