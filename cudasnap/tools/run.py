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
from the shared-memory slot its predecessor left (see cudasnap.dist).
``cudasnap run`` supervises single-process jobs (or one torchrun agent:
``cudasnap run -- torchrun ...`` flushes every rank's arena when the agent dies).
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .._native import native
from ..config import Settings
from ..errors import ConfigError, SnapshotError
from ..format import paths
from ..storage import posix
from .standby import Standby

log = logging.getLogger("cudasnap.run")

EXIT_CODES = {75: "GPU lost", 76: "GPU fault", 77: "hang", 78: "preempted", 79: "peer failure"}


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}" + (f" ({EXIT_CODES[rc]})" if rc in EXIT_CODES else "")


def _orphan_slots(directory: Path, job: str, shm_dir: Path) -> list[tuple[Path, Any, int, int]]:
    """(path, arena, slot, step) of each arena's newest COMPLETE slot newer than disk, leased.

    Fast (no I/O but the arena headers): done before the restart, so that the
    restarted process cannot overwrite a slot that is still to be flushed.
    """
    C = native()
    out = []
    on_disk = {s.step for s in posix.list_snapshots(directory)}
    for path in sorted(shm_dir.glob(paths.arena_glob(job))):
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
            out.append((path, arena, -1, step))
            continue
        arena.lease(slot)
        out.append((path, arena, slot, step))
    return out


def _flush_leased(directory: Path, leased: list[tuple[Path, Any, int, int]],
                  threads: int = 4) -> list[dict[str, Any]]:
    """Writes each leased slot; a failure (disk full) is logged and the arena kept."""
    done: list[dict[str, Any]] = []
    for path, arena, slot, step in leased:
        if slot < 0:
            done.append({"arena": str(path), "step": step, "seconds": 0.0, "skipped": True})
            continue
        t0 = time.perf_counter()
        try:
            target, st = posix.write_slot(arena, slot, directory, threads=threads)
            done.append({"arena": str(path), "step": step, "seconds": time.perf_counter() - t0,
                         "bytes": st["bytes"], "path": str(target)})
            log.warning("flushed step %d left in %s to %s (%.2f s)", step, path, target,
                        time.perf_counter() - t0)
        except (SnapshotError, OSError) as e:
            log.error("could not flush step %d left in %s: %s; the arena is kept (a restarted "
                      "job restores from it)", step, path, e)
            done.append({"arena": str(path), "step": step, "error": str(e),
                         "seconds": time.perf_counter() - t0})
        finally:
            arena.release(slot)
    return done


def flush_orphans(directory: Path, job: str, shm_dir: Path, threads: int = 4) -> list[dict[str, Any]]:
    """Flushes every COMPLETE slot of ``job``'s arenas that is newer than disk."""
    return _flush_leased(directory, _orphan_slots(directory, job, shm_dir), threads)


class SupervisorLock:
    """One ``cudasnap run`` per directory: flock on DIR/.supervisor-lock for the whole run."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / ".supervisor-lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(f"snapshot directory {self.path.parent} is in use by another job "
                              f"(cudasnap run {owner}); use another directory or stop that "
                              "job") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _check_not_in_use(directory: Path, dead_child: int | None = None) -> None:
    """Raises ConfigError when another job holds the directory.

    A holder that names ``dead_child`` is ours: a process it forked (a data-loader
    worker) still has the lock's file open for a moment after the child died.
    """
    lock = posix.DirectoryLock(directory)
    try:
        lock.acquire()
    except ConfigError:
        try:
            owner = (Path(directory) / ".lock").read_text().split()
        except OSError:
            owner = []
        if dead_child is not None and f"pid={dead_child}" in owner:
            _wait_released(lock.path, _WORKER_GRACE_S)
            return
        raise
    lock.release()


_WORKER_GRACE_S = 30.0


def _wait_released(path: Path, timeout: float) -> None:
    """Waits (blocking flock in a helper thread, no polling) for a dead child's workers
    to close the directory lock, so that the restarted child can take it."""
    released = threading.Event()
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def take_and_drop() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            released.set()

    threading.Thread(target=take_and_drop, name="cudasnap-lock-wait", daemon=True).start()
    if not released.wait(timeout):
        log.warning("%s is still held by a process the dead training process started, after "
                    "%.0f s; restarting anyway", path, timeout)


def _resume_point(directory: Path, job: str, shm: Path) -> str | None:
    """Where a run would resume from: "step N (source)", or None for a fresh start."""
    best: tuple[int, str] | None = None
    arenas = sorted(shm.glob(paths.arena_glob(job)))
    if arenas:
        C = native()
        for p in arenas:
            try:
                a = C.Arena.open(str(p), False)
                slot = a.newest_complete()
                if slot >= 0:
                    step = int(a.slot_info(slot)["step"])
                    if best is None or step > best[0]:
                        best = (step, f"shared memory {p}")
            except SnapshotError:
                continue
    snaps = posix.list_snapshots(directory)
    if snaps and (best is None or snaps[0].step > best[0]):
        best = (snaps[0].step, str(snaps[0].path))
    return None if best is None else f"step {best[0]} ({best[1]})"


def start_over(directory: Path) -> Path | None:
    """``--fresh``: moves the snapshots aside (as ``fresh=True`` does) and renews the
    directory's identity, so this job's old arenas are not adopted (``gc`` removes them)."""
    from ..core.timeline import move_aside

    aside = move_aside(directory, None, threads=1)
    paths.renew_id(directory)
    return aside


def _command_exists(cmd: list[str]) -> None:
    exe = cmd[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise ConfigError(f"command not found or not executable: {exe}")
    elif shutil.which(exe) is None:
        raise ConfigError(f"command not found: {exe}")


def supervise(cmd: list[str], directory: Path, *, max_restarts: int = 3,
              shm_dir: Path | None = None, inject_first: str | None = None,
              watchdog_s: float | None = None, extra_env: dict[str, str] | None = None,
              report: list[dict[str, Any]] | None = None, auto: bool = False,
              fresh: bool = False, warm: bool = True) -> int:
    """Runs ``cmd`` until it exits 0 or ``max_restarts`` restarts are used; returns its code.

    ``warm``: keep the next attempt's interpreter started, torch imported, waiting
    (``python SCRIPT``/``python -m MODULE`` commands; cudasnap.tools.standby), so a
    restart skips the imports; ``--no-warm`` starts every attempt cold.

    Bad input (no or unknown command, a directory that is a file or busy) raises
    ConfigError before anything is started or touched.
    """
    if not cmd:
        raise SystemExit("cudasnap run: no command given (usage: cudasnap run [options] -- cmd ...)")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, not {max_restarts}")
    _command_exists(cmd)
    directory = posix.check_directory(directory)
    cfg = Settings.from_env()
    shm = Path(shm_dir) if shm_dir else cfg.shm_dir
    lock = SupervisorLock(directory)
    lock.acquire()
    try:
        _check_not_in_use(directory)
        if fresh:
            aside = start_over(directory)
            log.warning("--fresh: starting over in %s%s", directory,
                        f" (old snapshots moved to {aside})" if aside else "")
        # (logs the arenas of an earlier directory at this path, which are not adopted)
        job = cfg.job or paths.snapshotter_job(directory, shm)
        if not fresh:
            where = _resume_point(directory, job, shm)
            if where is not None:
                log.warning("resuming from %s in %s; pass --fresh to start over", where, directory)
        return _supervise_locked(cmd, directory, job, shm, max_restarts=max_restarts,
                                 inject_first=inject_first, watchdog_s=watchdog_s,
                                 extra_env=extra_env, report=report, auto=auto,
                                 warm_next=warm)
    finally:
        lock.release()


def _supervise_locked(cmd: list[str], directory: Path, job: str, shm: Path, *,
                      max_restarts: int, inject_first: str | None, watchdog_s: float | None,
                      extra_env: dict[str, str] | None, report: list[dict[str, Any]] | None,
                      auto: bool, warm_next: bool = True) -> int:
    # Load the extension (and torch) now, beside the first attempt: after a death the
    # flush must start at once, not after a multi-second import.
    preload = threading.Thread(target=native, name="cudasnap-preload", daemon=True)
    preload.start()
    flusher: threading.Thread | None = None
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

    def finish(rc: int) -> int:
        if flusher is not None:
            flusher.join()
        return rc if rc >= 0 else 128 - rc

    def attempt_env(n: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CUDASNAP_HEALTH": "1", "CUDASNAP_DIR": str(directory),
                    "CUDASNAP_JOB": job, "CUDASNAP_SHM_DIR": str(shm),
                    "CUDASNAP_RESTART": str(n), "CUDASNAP_SUPERVISED": "1"})
        if watchdog_s:
            env["CUDASNAP_WATCHDOG_S"] = str(watchdog_s)
        if auto:
            env["CUDASNAP_AUTO"] = "1"
            pkg = Path(__file__).resolve().parents[1]  # cudasnap/
            env["PYTHONPATH"] = os.pathsep.join(
                [str(pkg / "_autoload"), str(pkg.parent)] +
                ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if inject_first and n == 0:
            env["CUDASNAP_INJECT"] = inject_first
        elif n > 0:
            env.pop("CUDASNAP_INJECT", None)
        env.update(extra_env or {})
        return env

    standby: Standby | None = None
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        while True:
            t_start = time.time()
            warm = standby.go() if standby is not None else None
            standby = None
            child = warm if warm is not None else subprocess.Popen(cmd, env=attempt_env(attempt))
            if warm_next and attempt < max_restarts:
                # The next attempt's interpreter, torch imported, waiting for this one's
                # death (cudasnap.tools.standby): a restart then skips the imports.
                standby = Standby.spawn(cmd, attempt_env(attempt + 1))
            if stop_requested and child.poll() is None:
                # The signal came before this child existed (or during the restart
                # gap): it must not run on as if nothing had been asked.
                log.warning("forwarding %s to the training process", stop_signal.name)
                child.send_signal(stop_signal)
            rc = child.wait()  # blocking waitpid: the death is noticed at once
            t_dead = time.time()
            entry: dict[str, Any] = {"attempt": attempt, "rc": rc, "started": t_start,
                                     "died": t_dead, "exit": describe_exit(rc),
                                     "warm": warm is not None}
            if report is not None:
                report.append(entry)
            if rc == 0:  # finished: never restarted
                return finish(0)
            log.warning("training process %s (attempt %d)", describe_exit(rc), attempt)
            if flusher is not None:
                flusher.join()  # the previous attempt's flush (one at a time)
            try:
                _check_not_in_use(directory, child.pid)
            except ConfigError as e:
                log.error("%s: not flushing, not restarting", e)
                return 2
            entry["flush_start"] = time.time()
            leased: list[tuple[Path, Any, int, int]] = []
            if any(shm.glob(paths.arena_glob(job))):  # else no need to wait for torch
                preload.join()
                leased = _orphan_slots(directory, job, shm)

            def flush(entry: dict[str, Any] = entry,
                      leased: list[tuple[Path, Any, int, int]] = leased) -> None:
                entry["flushed"] = _flush_leased(directory, leased)
                entry["flush_done"] = time.time()

            # The flush runs beside the restart: the restarted process restores from
            # shared memory anyway, and the leased slot is not reused until it is written.
            flusher = threading.Thread(target=flush, name="cudasnap-orphan-flush", daemon=True)
            flusher.start()
            if stop_requested:
                log.warning("stop requested: not restarting")
                return finish(rc)
            if attempt >= max_restarts:
                log.error("giving up after %d restart(s)", max_restarts)
                return finish(rc)
            attempt += 1
            log.warning("restarting (restart %d of %d)", attempt, max_restarts)
    finally:
        if standby is not None:
            standby.cancel()
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cudasnap run", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=Settings.from_env().directory or "ckpt",
                   help="snapshot directory (exported as CUDASNAP_DIR)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--watchdog", type=float, default=None, help="hang timeout in seconds")
    p.add_argument("--inject", default=None, help="fault injection for the first attempt")
    p.add_argument("--auto", action="store_true",
                   help="transparent mode for scripts without cudasnap code (no bitwise resume)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: move the directory's snapshots aside, ignore its arenas")
    p.add_argument("--no-warm", action="store_true",
                   help="no warm standby: every restart imports torch anew (saves its memory)")
    p.add_argument("--debug", action="store_true", help="tracebacks for errors")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command ...")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cudasnap-run %(message)s")
    try:
        if a.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, not {a.max_restarts}")
        if a.watchdog is not None and not a.watchdog > 0:
            raise ConfigError(f"--watchdog must be a positive number of seconds, not {a.watchdog}")
        return supervise(cmd, Path(a.dir), max_restarts=a.max_restarts, inject_first=a.inject,
                         watchdog_s=a.watchdog, auto=a.auto, fresh=a.fresh,
                         warm=not a.no_warm)
    except (SnapshotError, OSError) as e:
        if a.debug:
            raise
        sys.stderr.write(f"cudasnap run: error: {e}\n")  # the CLI's one-line error
        return 2


if __name__ == "__main__":
    sys.exit(main())
