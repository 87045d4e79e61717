"""Warm standby for ``cudasnap run``: the next attempt's interpreter, torch already imported.

After a death most of the time to the first resumed step is a new interpreter
importing torch (and ``torch._dynamo``, which the first optimizer pulls in):
seconds, against a fraction of a second for the restore itself. The supervisor
therefore starts the NEXT attempt ahead of time, with that attempt's exact
environment: ``python -m cudasnap.tools.standby FD -- ARGS`` (FD: the read end of the
supervisor's pipe, inherited) imports torch and cudasnap
(never CUDA: the process holds no device context while it waits), then blocks
on a pipe. When the running attempt dies the supervisor writes one line
(``go``) and this process runs the user's script in place (``runpy``: the same
``__main__`` semantics as ``python script.py`` / ``python -m module``). An empty
read (the supervisor closed the pipe or died) ends the process quietly.

Only plain ``python SCRIPT args`` and ``python -m MODULE args`` commands are
run this way (:func:`warm_command`); anything else restarts cold.
"""
from __future__ import annotations

import logging
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("cudasnap.standby")

# Set in the standby process when "go" arrives (the resumed script reads it through
# sys.modules["cudasnap.tools.standby"] to report its recovery time honestly).
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
            # Own process group: a terminal's Ctrl-C must not kill a standby that has
            # not started (the supervisor forwards signals to the running attempt).
            proc = subprocess.Popen([cmd[0], "-m", "cudasnap.tools.standby", str(r), "--", *args],
                                    env=env, pass_fds=(r,), start_new_session=True)
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
    fd = int(sys.argv[1])
    args = sys.argv[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    t0 = time.monotonic()
    preload()
    log.debug("standby ready in %.2f s", time.monotonic() - t0)
    ready = time.time()
    with os.fdopen(fd, "rb", buffering=0) as f:
        line = f.readline()
    if line.strip() != b"go":
        return 0  # cancelled: the supervisor is done or gone
    # This file runs as __main__; the script finds the times under the module's name.
    import cudasnap.tools.standby as named

    named.ready_time, named.go_time = ready, time.time()
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
