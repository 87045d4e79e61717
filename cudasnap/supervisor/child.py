"""One attempt's process, as the supervisor starts, waits for and describes it.

Owns: the command a cold attempt runs (:func:`_command_exists` checks it first,
:func:`_cold_command` routes a python command through cudasnap.supervisor.standby);
waiting for the attempt to end, including a SIGSTOPped one and the hang policy's
watchdog (:func:`_wait_child`, :func:`_hang_rule`); how it ended (:func:`describe_exit`,
:data:`EXIT_CODES`); the configuration error it reported (:func:`_read_verdict`).

Call order (cudasnap.supervisor.loop): ``_command_exists`` before anything starts; per
attempt ``_cold_command`` (when no warm standby runs it) -> ``_wait_child`` ->
``describe_exit`` -> ``_read_verdict`` (a configuration error stops the restarts).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .._proc import process_state
from ..config import Settings
from ..errors import ConfigError
from ..triggers.kinds import ExitCode
from .standby import warm_command

log = logging.getLogger("cudasnap.run")

EXIT_CODES = {int(c): c.describe for c in ExitCode if c >= 64}  # the guard's flush-and-exit


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}" + (f" ({EXIT_CODES[rc]})" if rc in EXIT_CODES else "")


def _command_exists(cmd: list[str]) -> None:
    exe = cmd[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise ConfigError(f"command not found or not executable: {exe}")
    elif shutil.which(exe) is None:
        raise ConfigError(f"command not found: {exe}")


def _cold_command(cmd: list[str]) -> list[str]:
    """The command of a cold attempt: a python command of this interpreter runs through
    ``python -m cudasnap.supervisor.standby --now`` (its configuration errors are reported to
    the supervisor); anything else (other interpreters, wrappers, torchrun) as given."""
    args = warm_command(cmd)
    exe = shutil.which(cmd[0]) if os.sep not in cmd[0] else cmd[0]
    if args is None or exe is None or os.path.abspath(exe) != os.path.abspath(sys.executable):
        return cmd
    return [cmd[0], "-m", "cudasnap.supervisor.standby", "--now", "--", *args]


def _read_verdict(verdict: Path | None) -> str | None:
    """The configuration error the attempt reported (cudasnap.supervisor.standby), or None."""
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
