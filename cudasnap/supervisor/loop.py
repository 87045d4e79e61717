"""The restart loop of ``cudasnap run``: :func:`supervise`.

Owns: the checks before anything starts, each attempt's environment, the stop signals
forwarded to the running attempt, the warm standby of the next attempt, and the verdict
after each death (finished, stop requested, configuration error, restarts used up, or
restart).

Call order: :func:`supervise` checks its input (cudasnap.supervisor.child,
cudasnap.supervisor.directory), takes the directory, then :func:`_supervise_locked` loops:
start the attempt (warm from the standby, or cold) -> spawn the next standby ->
``_wait_child`` -> ``_check_not_in_use`` -> lease the dead attempt's slots and flush them in
a thread beside the restart (cudasnap.supervisor.orphans) -> verdict -> restart.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._proc import parent_death_signal
from ..config import Settings
from ..errors import ConfigError
from ..format import paths, run_notes
from .child import _cold_command, _command_exists, _read_verdict, _wait_child, describe_exit
from .directory import (
    SupervisorLock,
    _check_not_in_use,
    _resume_point,
    open_directory,
    start_over,
)
from .orphans import _flush_leased, _orphan_slots, _remove_own_partial
from .standby import VERDICT_ENV, Standby

if TYPE_CHECKING:
    from ..storage.protocol import Storage

log = logging.getLogger("cudasnap.run")


def supervise(cmd: list[str], directory: Path | str, *, max_restarts: int = 3,
              shm_dir: Path | None = None, inject_first: str | None = None,
              watchdog_s: float | None = None, extra_env: dict[str, str] | None = None,
              report: list[dict[str, Any]] | None = None, auto: bool = False,
              fresh: bool = False, warm: bool = True) -> int:
    """Runs ``cmd`` until it exits 0 or ``max_restarts`` restarts are used; returns its code.

    ``warm``: keep the next attempt's interpreter started, torch imported, waiting
    (``python SCRIPT``/``python -m MODULE`` commands; cudasnap.supervisor.standby), so a
    restart skips the imports; ``--no-warm`` starts every attempt cold.

    ``directory``: a file-system directory or an object-store URL (a ``str``,
    ``s3://bucket/prefix``): the training process gets the URL as CUDASNAP_DIR, the dead
    attempt's arena is flushed to the store, and the supervisor's own state lives in
    the URL's local state directory (cudasnap.supervisor.directory.open_directory).

    Bad input (no or unknown command, a directory that is a file or busy) raises
    ConfigError before anything is started or touched.
    """
    if not cmd:
        raise ConfigError("no command given (usage: cudasnap run [options] -- cmd ...)")
    url = str(directory) if paths.is_url(directory) else None
    if url is not None and fresh:
        raise ConfigError(f"--dir {url}: --fresh cannot move object-store snapshots aside "
                          "(no rename in an object store); start fresh under a new URL "
                          "prefix instead")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, not {max_restarts}")
    _command_exists(cmd)
    cfg = Settings.from_env()
    directory, remote = open_directory(directory, cfg)
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
        if url is not None and cfg.job:
            # The training process compares CUDASNAP_DIR (the URL) with its directory (the
            # state directory) and drops an exported job that does not match: both derive it.
            log.warning("CUDASNAP_JOB=%s is ignored with an object-store --dir: the job is "
                        "derived from %s's state directory", cfg.job, url)
            job = paths.snapshotter_job(directory, shm)
        if not fresh:
            where = _resume_point(directory, job, shm, remote)
            if where is not None:
                log.warning("resuming from %s in %s unless the training process finds it "
                            "damaged (it verifies every checksum when it restores, and logs "
                            "the step it resumes from); pass --fresh to start over", where,
                            directory)
        with tempfile.TemporaryDirectory(prefix="cudasnap-run-") as tmp:
            return _supervise_locked(cmd, directory, job, shm, max_restarts=max_restarts,
                                     inject_first=inject_first, watchdog_s=watchdog_s,
                                     extra_env=extra_env, report=report, auto=auto,
                                     warm_next=warm, verdict=Path(tmp) / "verdict.json",
                                     url=url, remote=remote)
    finally:
        lock.release()


def _supervise_locked(cmd: list[str], directory: Path, job: str, shm: Path, *,
                      max_restarts: int, inject_first: str | None, watchdog_s: float | None,
                      extra_env: dict[str, str] | None, report: list[dict[str, Any]] | None,
                      auto: bool, warm_next: bool = True, verdict: Path | None = None,
                      url: str | None = None, remote: Storage | None = None) -> int:
    # The extension (and torch) loaded beside the first attempt: a flush after a death starts at once
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
        return _exit_status(verdict, rc)

    def attempt_env(n: int) -> dict[str, str]:
        return _attempt_env(n, directory=directory, url=url, job=job, shm=shm, verdict=verdict,
                            watchdog_s=watchdog_s, auto=auto, inject_first=inject_first,
                            extra_env=extra_env)

    standby: Standby | None = None
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        while True:
            t_start = time.time()
            warm = standby.go() if standby is not None else None
            standby = None
            if verdict is not None:
                verdict.unlink(missing_ok=True)
            child = warm if warm is not None else _cold_start(cmd, attempt_env(attempt))
            if warm_next and attempt < max_restarts:
                # The next attempt's interpreter, torch imported, waiting for this one's
                # death (cudasnap.supervisor.standby): a restart then skips the imports.
                standby = Standby.spawn(cmd, attempt_env(attempt + 1))
            if stop_requested and child.poll() is None:
                # The signal came before this child existed (or in the restart gap): forwarded
                log.warning("forwarding %s to the training process", stop_signal.name)
                child.send_signal(stop_signal)
            rc, how = _wait_child(child, watchdog_s or cfg_watchdog)
            entry: dict[str, Any] = {"attempt": attempt, "rc": rc, "started": t_start, "died": time.time(),
                                     "exit": how or describe_exit(rc), "warm": warm is not None}
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
            flusher = _orphan_flush(directory, job, shm, remote, preload, entry, wait=auto)
            if not _restart(stop_requested, config_error, attempt, max_restarts, entry):
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


def _orphan_flush(directory: Path, job: str, shm: Path, remote: Storage | None,
                  preload: threading.Thread, entry: dict[str, Any],
                  wait: bool = False) -> threading.Thread:
    """The dead attempt's newest slots leased now and flushed on a thread, beside the
    restart: the restarted process restores from shared memory anyway, and a leased slot is
    not reused until it is written. ``entry`` (the attempt's report) gets the times and
    what was flushed. ``wait``: returns once the flush is done (``--auto``: the restarted
    script starts over and moves this flush's step aside, cudasnap.tools.auto)."""
    entry["flush_start"] = time.time()
    leased: list[tuple[Path, Any, int, int]] = []
    if any(shm.glob(paths.arena_glob(job))):  # else no need to wait for torch
        preload.join()
        leased = _orphan_slots(directory, job, shm, remote)

    def flush() -> None:
        entry["flushed"] = _flush_leased(directory, leased, remote=remote)
        entry["flush_done"] = time.time()

    t = threading.Thread(target=flush, name="cudasnap-orphan-flush", daemon=True)
    t.start()
    if wait:
        t.join()
    return t


def _exit_status(verdict: Path | None, rc: int) -> int:
    """``cudasnap run``'s exit status (a signal's death: 128 + its number) and summary: an
    attempt that started over at step 0 after progress (cudasnap.format.run_notes) is
    named at ERROR, whatever the status."""
    lost = run_notes.read_started_over(verdict)
    if lost:
        log.error("cudasnap run: the job ended (exit %d), but an attempt started over at step "
                  "0 although the job had made progress nothing could restore: %s. "
                  "CUDASNAP_REQUIRE_RESUME=1 makes such an attempt fail instead", rc, lost)
    return rc if rc >= 0 else 128 - rc


def _attempt_env(n: int, *, directory: Path, url: str | None, job: str, shm: Path,
                 verdict: Path | None, watchdog_s: float | None, auto: bool,
                 inject_first: str | None, extra_env: dict[str, str] | None) -> dict[str, str]:
    """The environment of attempt ``n``: the guard on, the snapshot directory, job, shared
    memory and restart count the attempt's Snapshotter reads (cudasnap.config), the fault
    injection of the first attempt only, ``extra_env`` last."""
    env = dict(os.environ)
    env.update({"CUDASNAP_HEALTH": "1", "CUDASNAP_DIR": url or str(directory),
                "CUDASNAP_JOB": job, "CUDASNAP_SHM_DIR": str(shm),
                "CUDASNAP_RESTART": str(n), "CUDASNAP_SUPERVISED": "1",
                "CUDASNAP_SUPERVISOR_PID": str(os.getpid())})
    if url is not None:  # derived from the state directory, as here (see supervise)
        env.pop("CUDASNAP_JOB")
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


def _cold_start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """An attempt started from scratch, in the supervisor's process group; SIGTERM (its
    guard flushes) if the supervisor dies."""
    return subprocess.Popen(_cold_command(cmd), env=env,
                            preexec_fn=parent_death_signal(signal.SIGTERM, os.getpid()))


def _restart(stop_requested: bool, config_error: str | None, attempt: int, max_restarts: int,
             entry: dict[str, Any]) -> bool:
    """Whether a failed attempt is restarted (else why not, logged): not after a stop was
    asked, a configuration error (a restart cannot fix it), or the last restart."""
    if stop_requested:
        log.warning("stop requested: not restarting")
        return False
    if config_error is not None:
        entry["config_error"] = config_error
        log.error("the training process failed with a configuration error (%s): a "
                  "restart cannot fix it, not restarting", config_error)
        return False
    if attempt >= max_restarts:
        log.error("giving up after %d restart(s)", max_restarts)
        return False
    return True
