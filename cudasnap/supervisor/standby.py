"""Warm standby for ``cudasnap run``: the next attempt's interpreter, torch already imported.

After a death most of the time to the first resumed step is a new interpreter
importing torch (and ``torch._dynamo``, which the first optimizer pulls in):
seconds, against a fraction of a second for the restore itself. The supervisor
therefore starts the NEXT attempt ahead of time, with that attempt's exact
environment: ``python -m cudasnap.supervisor.standby FD -- ARGS`` (FD: the read end of the
supervisor's pipe, inherited) imports torch and cudasnap
(never CUDA: the process holds no device context while it waits), then blocks
on a pipe. When the running attempt dies the supervisor writes one line
(``go``) and this process runs the user's script in place (``runpy``: the same
``__main__`` semantics as ``python script.py`` / ``python -m module``). An empty
read (the supervisor closed the pipe or died) ends the process quietly.

Only plain ``python SCRIPT args`` and ``python -m MODULE args`` commands are
run this way (:func:`warm_command`); anything else restarts cold.

The standby is in the supervisor's process group (a scheduler's ``kill -- -PGID``
ends it and, once started, the training it runs) and gets SIGTERM when the
supervisor dies (``PR_SET_PDEATHSIG``): it never outlives its supervisor. While it
waits it ignores SIGINT (a terminal's Ctrl-C reaches the whole foreground group;
the supervisor forwards it to the running attempt); ``go`` restores Python's
KeyboardInterrupt handler before the script runs.

``python -m cudasnap.supervisor.standby --now -- ARGS`` runs the script at once (no
preload): ``cudasnap run``'s cold attempts of python commands. In both modes a
configuration error escaping the script (:data:`CONFIG_ERRORS`: ConfigError,
StagingError, e.g. a /dev/shm too small for the arena) is written to the file named
by ``CUDASNAP_RUN_VERDICT`` before Python reports it as usual (traceback, exit 1):
the supervisor then stops with that error instead of restarting a run that cannot work.
"""
from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from .._proc import parent_death_signal
from ..errors import ConfigError, StagingError

log = logging.getLogger("cudasnap.standby")

#: errors that a restart cannot fix: the supervisor stops on them (CUDASNAP_RUN_VERDICT)
CONFIG_ERRORS: tuple[type[BaseException], ...] = (ConfigError, StagingError)
VERDICT_ENV = "CUDASNAP_RUN_VERDICT"

# Set in the standby process when "go" arrives (the resumed script reads it through
# sys.modules["cudasnap.supervisor.standby"] to report its recovery time honestly).
go_time: float | None = None
ready_time: float | None = None

def warm_command(cmd: list[str]) -> list[str] | None:
    """``cmd`` without its interpreter when a standby can run it (``[script, args..]`` or
    ``["-m", module, args..]``), else None: other interpreters, interpreter flags, wrappers."""
    if len(cmd) < 2:
        return None
    exe = Path(cmd[0]).name
    same = os.path.realpath(cmd[0]) == os.path.realpath(sys.executable) or \
        exe in ("python", "python3", f"python3.{sys.version_info[1]}")
    if not same:
        return None
    if cmd[1] == "-m":
        return cmd[1:] if len(cmd) >= 3 else None
    if cmd[1].startswith("-"):
        return None  # -u, -X, -c ...: the interpreter's own options, honoured only cold
    return cmd[1:]


def preload() -> None:
    """Imports what every training script imports first. None of it initialises CUDA."""
    import torch  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401  (the first optimizer imports it: ~40% of the time)
    except Exception as e:  # noqa: BLE001 - a torch without it still runs the script
        log.debug("torch._dynamo not preloaded: %s", e)
    import cudasnap.snapshotter  # noqa: F401


def write_verdict(exc: BaseException) -> None:
    """Records a configuration error for the supervisor (CUDASNAP_RUN_VERDICT; 0600)."""
    from ..config import run_verdict_path

    path = run_verdict_path()  # alone: another variable may be the error reported
    if not path:
        return
    body = json.dumps({"kind": "config", "error": f"{type(exc).__name__}: {exc}",
                       "pid": os.getpid()}).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:  # the supervisor then restarts as for any failure
        log.warning("could not record the configuration error for cudasnap run: %s", e)


def run_reporting(args: list[str]) -> None:
    """:func:`run`, recording a configuration error (:data:`CONFIG_ERRORS`) that escapes
    the script before it propagates unchanged (Python prints it and exits 1)."""
    try:
        run(args)
    except CONFIG_ERRORS as e:
        write_verdict(e)
        raise


def run(args: list[str]) -> None:
    """Runs ``args`` (from :func:`warm_command`) as ``python`` would."""
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy replaces argv[0] with the module's path
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        # `python script.py` puts the script's folder first; `-m` (this process) put the cwd.
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


class Standby:
    """Supervisor side: one warm interpreter for the next attempt of ``cmd``.

    ``Standby.spawn(cmd, env)`` returns None when ``cmd`` cannot run warm. ``go()``
    releases it and returns its Popen (None if it died meanwhile: start cold);
    ``cancel()`` closes the pipe and kills and reaps it.
    """

    def __init__(self, proc: subprocess.Popen[bytes], wfd: int) -> None:
        self.proc, self._w = proc, wfd

    @classmethod
    def spawn(cls, cmd: list[str], env: dict[str, str]) -> Standby | None:
        args = warm_command(cmd)
        if args is None:
            return None
        r, w = os.pipe()
        try:
            # The supervisor's process group (a group kill ends it too), SIGTERM when the
            # supervisor dies, SIGINT ignored until "go" (see the module docstring).
            proc = subprocess.Popen([cmd[0], "-m", "cudasnap.supervisor.standby", str(r), "--", *args],
                                    env=env, pass_fds=(r,),
                                    preexec_fn=parent_death_signal(signal.SIGTERM, os.getpid(),
                                                                   ignore=(signal.SIGINT,)))
        except OSError as e:
            os.close(w)
            log.warning("no warm standby (%s): the next restart starts cold", e)
            return None
        finally:
            os.close(r)
        return cls(proc, w)

    def go(self) -> subprocess.Popen[bytes] | None:
        """Starts the script in the standby; None (and reaped) if it is gone."""
        if self.proc.poll() is None:
            try:
                os.write(self._w, b"go\n")
            except OSError:  # it died between poll() and write(): EPIPE
                pass
            else:
                self._close()
                return self.proc
        log.warning("warm standby exited early (%s): starting cold", self.proc.poll())
        self.cancel()
        return None

    def cancel(self) -> None:
        """Ends an unused standby at once (it holds no state: nothing to wait for)."""
        self._close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _close(self) -> None:
        if self._w >= 0:
            os.close(self._w)
            self._w = -1


def main() -> int:
    args = sys.argv[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if sys.argv[1] == "--now":  # a cold attempt: run at once, configuration errors recorded
        run_reporting(args)
        return 0
    fd = int(sys.argv[1])
    t0 = time.monotonic()
    preload()
    log.debug("standby ready in %.2f s", time.monotonic() - t0)
    ready = time.time()
    with os.fdopen(fd, "rb", buffering=0) as f:
        line = f.readline()
    if line.strip() != b"go":
        return 0  # cancelled: the supervisor is done or gone
    # This file runs as __main__; the script finds the times under the module's name.
    import cudasnap.supervisor.standby as named

    named.ready_time, named.go_time = ready, time.time()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any python process
    run_reporting(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
