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

The training process never outlives its supervisor: every attempt (and the warm
standby) is in the supervisor's process group, so a scheduler's ``kill -- -PGID``
ends them all, and gets SIGTERM from the kernel when the supervisor itself dies
(``PR_SET_PDEATHSIG``; its guard flushes and exits). A later ``cudasnap run`` on the
directory waits for such an orphan to finish instead of refusing at once.

A configuration error that a restart cannot fix (ConfigError, StagingError: e.g. a
/dev/shm too small for the arena) stops the supervisor with that error (python
commands; see cudasnap.tools.standby). A child stopped by SIGSTOP is logged; with a
watchdog (``--watchdog``/CUDASNAP_WATCHDOG_S) it is treated as a hang after that long,
per the hang policy (default: killed, its arena flushed, restarted; exit code 77).
Object-store URLs (``s3://``) are refused: ``cudasnap run`` needs a local or shared
file-system directory.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .._native import native
from .._proc import environ_of, parent_death_signal, ppid_of, process_state
from ..config import Settings
from ..errors import ConfigError, SnapshotError
from ..format import paths
from ..storage import posix
from .standby import VERDICT_ENV, Standby, warm_command

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
        except Exception as e:  # noqa: BLE001 - any failure: logged, the arena kept
            log.error("could not flush step %d left in %s: %s; the arena is kept (a restarted "
                      "job restores from it)", step, path, e)
            done.append({"arena": str(path), "step": step, "error": str(e),
                         "seconds": time.perf_counter() - t0})
            _remove_own_partial(directory, step)
        finally:
            arena.release(slot)
    return done


def _remove_own_partial(directory: Path, step: int | None = None) -> None:
    """Removes this process's ``step-N.tmp-<pid>`` directories (a flush that failed or
    was cut short); ``step`` None: every step's."""
    name = paths.step_dirname(step) if step is not None else "step-*"
    for p in [*Path(directory).glob(f"{name}.tmp-{os.getpid()}"),
              *Path(directory).glob(f"{name}/*.tmp-{os.getpid()}")]:
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            log.warning("removed %s, left by an interrupted flush of this supervisor", p)


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
            if not _wait_released(lock.path, _WORKER_GRACE_S):
                log.warning("%s is still held by a process the dead training process started, "
                            "after %.0f s; restarting anyway", lock.path, _WORKER_GRACE_S)
            return
        holder = next((int(w[4:]) for w in owner if re.fullmatch(r"pid=\d+", w)), None)
        sup = _orphaned_by(holder) if holder is not None else None
        if sup is None:
            raise
        log.warning("snapshot directory %s is held by pid %d, the training process of a "
                    "cudasnap run (pid %d) that died; waiting up to %.0f s for it to stop "
                    "(it was sent SIGTERM: it flushes, then exits)", directory, holder, sup,
                    _ORPHAN_GRACE_S)
        if not _wait_released(lock.path, _ORPHAN_GRACE_S):
            raise ConfigError(f"snapshot directory {directory} is still held by pid {holder}, "
                              f"left running by a cudasnap run (pid {sup}) that died; stop it "
                              f"(kill {holder}) or use another directory") from None
        log.warning("pid %d released %s: starting", holder, directory)
        lock.acquire()  # (raises if a third job took it meanwhile)
    lock.release()


_WORKER_GRACE_S = 30.0
_ORPHAN_GRACE_S = 120.0


def _orphaned_by(pid: int) -> int | None:
    """The pid of the dead ``cudasnap run`` whose training process ``pid`` is, or None.

    Every attempt is started with CUDASNAP_SUPERVISOR_PID; one whose parent is no longer
    that supervisor was orphaned (the kernel sends it SIGTERM: PR_SET_PDEATHSIG).
    """
    env = environ_of(pid)
    try:
        sup = int(env.get("CUDASNAP_SUPERVISOR_PID", ""))
    except ValueError:
        return None
    parent = ppid_of(pid)
    if parent is None or parent == sup:
        return None
    return sup


def _wait_released(path: Path, timeout: float) -> bool:
    """Waits (blocking flock in a helper thread, no polling) for the processes still
    holding the directory lock (a dead child's workers, an orphan of a dead supervisor)
    to close it; True once released, False after ``timeout`` seconds."""
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
    return released.wait(timeout)


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
    for s in posix.list_snapshots(directory):
        if best is not None and s.step <= best[0]:
            break
        problem = _damaged(s.path)
        if problem is None:
            best = (s.step, str(s.path))
            break
        log.warning("step %d in %s is damaged (%s): not a resume point", s.step, directory,
                    problem)
    return None if best is None else f"step {best[0]} ({best[1]})"


def _damaged(step_dir: Path) -> str | None:
    """What the supervisor checks of a snapshot on disk before naming it (cheap: no data
    is read): each manifest present parses and passes its own CRC, its data file has the
    manifest's size, a multi-rank step is committed. None when nothing is wrong. The
    data's checksums are verified by the training process when it restores."""
    subs = sorted(p for p in step_dir.glob("rank-*") if p.is_dir() and "." not in p.name)
    if subs and not posix.is_committed(step_dir):
        return "not committed"
    for d in subs or [step_dir]:
        if not (d / paths.MANIFEST).exists():
            continue  # nothing to check here: the restore decides
        try:
            m = posix.load_manifest(d / paths.MANIFEST)
            data = d / m["data"]["file"]
            size = data.stat().st_size
        except (SnapshotError, OSError, KeyError, TypeError) as e:
            return str(e)
        if size != int(m["data"]["bytes"]):
            return f"{data} is {size} bytes, its manifest says {m['data']['bytes']}"
    return None


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


_OBJECT_STORE = re.compile(r"^(s3a?|gs|gcs|az|abfss?|adl|oss|r2|hf|https?|memory):/", re.I)


def _refuse_url(directory: Path | str) -> None:
    """ConfigError for an object-store URL (also one a Path has collapsed to ``s3:/b/p``)."""
    text = str(directory)
    if paths.is_url(text) or _OBJECT_STORE.match(text):
        raise ConfigError(
            f"--dir {text}: cudasnap run needs a local or shared file-system directory; "
            "object stores (s3:// ...) are not supported under cudasnap run yet (its flush "
            "of a dead attempt's arena and its directory lock are local). Use a file-system "
            "directory, or Snapshotter(directory=URL) without cudasnap run")


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
        raise ConfigError("no command given (usage: cudasnap run [options] -- cmd ...)")
    _refuse_url(directory)
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
                log.warning("resuming from %s in %s unless the training process finds it "
                            "damaged (it verifies every checksum when it restores, and logs "
                            "the step it resumes from); pass --fresh to start over", where,
                            directory)
        with tempfile.TemporaryDirectory(prefix="cudasnap-run-") as tmp:
            return _supervise_locked(cmd, directory, job, shm, max_restarts=max_restarts,
                                     inject_first=inject_first, watchdog_s=watchdog_s,
                                     extra_env=extra_env, report=report, auto=auto,
                                     warm_next=warm, verdict=Path(tmp) / "verdict.json")
    finally:
        lock.release()


def _supervise_locked(cmd: list[str], directory: Path, job: str, shm: Path, *,
                      max_restarts: int, inject_first: str | None, watchdog_s: float | None,
                      extra_env: dict[str, str] | None, report: list[dict[str, Any]] | None,
                      auto: bool, warm_next: bool = True, verdict: Path | None = None) -> int:
    # Load the extension (and torch) now, beside the first attempt: after a death the
    # flush must start at once, not after a multi-second import.
    preload = threading.Thread(target=native, name="cudasnap-preload", daemon=True)
    preload.start()
    flusher: threading.Thread | None = None
    cfg_watchdog = Settings.from_env().watchdog_s
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
                    "CUDASNAP_RESTART": str(n), "CUDASNAP_SUPERVISED": "1",
                    "CUDASNAP_SUPERVISOR_PID": str(os.getpid())})
        if verdict is not None:
            env[VERDICT_ENV] = str(verdict)
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
            if verdict is not None:
                verdict.unlink(missing_ok=True)
            # The supervisor's process group; SIGTERM (its guard flushes) if we die.
            child = warm if warm is not None else subprocess.Popen(
                _cold_command(cmd), env=attempt_env(attempt),
                preexec_fn=parent_death_signal(signal.SIGTERM, os.getpid()))
            if warm_next and attempt < max_restarts:
                # The next attempt's interpreter, torch imported, waiting for this one's
                # death (cudasnap.tools.standby): a restart then skips the imports.
                standby = Standby.spawn(cmd, attempt_env(attempt + 1))
            if stop_requested and child.poll() is None:
                # The signal came before this child existed (or during the restart
                # gap): it must not run on as if nothing had been asked.
                log.warning("forwarding %s to the training process", stop_signal.name)
                child.send_signal(stop_signal)
            rc, how = _wait_child(child, watchdog_s or cfg_watchdog)
            t_dead = time.time()
            entry: dict[str, Any] = {"attempt": attempt, "rc": rc, "started": t_start,
                                     "died": t_dead, "exit": how or describe_exit(rc),
                                     "warm": warm is not None}
            if report is not None:
                report.append(entry)
            if rc == 0:  # finished: never restarted
                return finish(0)
            log.warning("training process %s (attempt %d)", how or describe_exit(rc), attempt)
            config_error = _read_verdict(verdict)
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
            if config_error is not None:
                entry["config_error"] = config_error
                log.error("the training process failed with a configuration error (%s): a "
                          "restart cannot fix it, not restarting", config_error)
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
        if flusher is not None:
            flusher.join()  # (an exception on the way out: the flush still completes)
        _remove_own_partial(directory)


_NO_COMMAND = "no command given (usage: cudasnap run [options] -- cmd ...)"


class UsageExit(SystemExit):
    """Exit status 2 (a usage error), its message kept for callers of :func:`main`."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _cold_command(cmd: list[str]) -> list[str]:
    """The command of a cold attempt: a python command of this interpreter runs through
    ``python -m cudasnap.tools.standby --now`` (its configuration errors are reported to
    the supervisor); anything else (other interpreters, wrappers, torchrun) as given."""
    args = warm_command(cmd)
    exe = shutil.which(cmd[0]) if os.sep not in cmd[0] else cmd[0]
    if args is None or exe is None or os.path.abspath(exe) != os.path.abspath(sys.executable):
        return cmd
    return [cmd[0], "-m", "cudasnap.tools.standby", "--now", "--", *args]


def _read_verdict(verdict: Path | None) -> str | None:
    """The configuration error the attempt reported (cudasnap.tools.standby), or None."""
    if verdict is None:
        return None
    try:
        rec = json.loads(verdict.read_text())
        verdict.unlink(missing_ok=True)
    except (OSError, ValueError):
        return None
    return str(rec.get("error")) if isinstance(rec, dict) and rec.get("kind") == "config" \
        else None


def _hang_rule() -> tuple[bool, int]:
    """(flush and exit?, exit code) of the hang policy (CUDASNAP_POLICY, default 77)."""
    from ..triggers.kinds import Trigger
    from ..triggers.policy import EXIT_HANG, Action, Policy

    try:
        action, code = Policy.parse(Settings.from_env().policy or "").decide(
            Trigger(kind="hang", detail="stopped"))
    except ConfigError:
        return True, EXIT_HANG
    return action is Action.FLUSH_AND_EXIT, EXIT_HANG if code is None else int(code)


def _wait_child(child: subprocess.Popen[bytes], watchdog_s: float | None
                ) -> tuple[int, str | None]:
    """Waits for ``child`` to end: (its return code, how it ended when not by itself).

    Blocking ``waitpid(WUNTRACED | WCONTINUED)``: a death is noticed at once, and so is
    a child stopped by SIGSTOP (it cannot run its own watchdog). A stopped child is
    logged; with a watchdog it is treated as a hang after ``watchdog_s`` seconds per
    the hang policy: killed (its newest COMPLETE slot is then flushed like any dead
    attempt's) and reported with the hang's exit code. Terminal job control
    (SIGTSTP/SIGTTIN/SIGTTOU) stops the whole group, the supervisor too: only logged.
    """
    timer: threading.Timer | None = None
    hung: list[int] = []
    pid = child.pid

    def kill_if_still_stopped(code: int, since: float) -> None:
        if process_state(pid) in ("T", "t"):
            hung.append(code)
            log.error("training process (pid %d) has been stopped for %.0f s: treated as a "
                      "hang (watchdog %.0f s): killing it", pid, time.monotonic() - since,
                      watchdog_s or 0)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    try:
        while True:
            try:
                got, status = os.waitpid(pid, os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:  # reaped by Popen.poll() (the signal forwarder)
                rc = child.returncode if child.returncode is not None else 0
                break
            if got != pid:
                continue
            if os.WIFSTOPPED(status):
                sig = os.WSTOPSIG(status)
                name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
                hang, code = _hang_rule()
                if sig == signal.SIGSTOP and watchdog_s and hang:
                    log.warning("training process (pid %d) stopped by %s; treated as a hang if "
                                "still stopped in %.0f s (watchdog)", pid, name, watchdog_s)
                    if timer is not None:
                        timer.cancel()
                    timer = threading.Timer(watchdog_s, kill_if_still_stopped,
                                            (code, time.monotonic()))
                    timer.daemon = True
                    timer.start()
                else:
                    log.warning("training process (pid %d) stopped by %s%s; waiting (SIGCONT "
                                "resumes it)", pid, name,
                                "" if watchdog_s else " (no --watchdog: never treated as a hang)")
                continue
            if os.WIFCONTINUED(status):
                if timer is not None:
                    timer.cancel()
                    timer = None
                log.warning("training process (pid %d) continued", pid)
                continue
            rc = os.waitstatus_to_exitcode(status)
            child.returncode = rc
            break
    finally:
        if timer is not None:
            timer.cancel()
    if hung:
        return hung[0], f"stopped (SIGSTOP) past the watchdog: treated as a hang, killed " \
            f"(exit code {hung[0]})"
    return rc, None


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
    if not cmd:  # a usage error: exit 2 with the usage, as argparse does
        p.print_usage(sys.stderr)
        sys.stderr.write(f"cudasnap run: error: {_NO_COMMAND}\n")
        raise UsageExit(_NO_COMMAND)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cudasnap-run %(message)s")
    try:
        _refuse_url(a.dir)
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
