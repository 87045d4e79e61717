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

The training process never outlives its supervisor: every attempt (and the warm
standby) is in the supervisor's process group, so a scheduler's ``kill -- -PGID``
ends them all, and gets SIGTERM from the kernel when the supervisor itself dies
(``PR_SET_PDEATHSIG``; its guard flushes and exits). A later ``cudasnap run`` on the
directory waits for such an orphan to finish instead of refusing at once.

A configuration error that a restart cannot fix (ConfigError, StagingError: e.g. a
/dev/shm too small for the arena) stops the supervisor with that error (python
commands; see cudasnap.supervisor.standby). A child stopped by SIGSTOP is logged; with a
watchdog (``--watchdog``/CUDASNAP_WATCHDOG_S) it is treated as a hang after that long,
per the hang policy (default: killed, its arena flushed, restarted; exit code 77).
``--dir s3://bucket/prefix`` (any fsspec URL): the training process gets the URL,
the dead attempt's arena is uploaded and committed to the store, and the
supervisor's local state (its lock, the directory id that names the arenas) lives
in the URL's state directory (``$CUDASNAP_STATE_DIR/url-<hash>``, default
``~/.cache/cudasnap/url-<hash>``; cudasnap.supervisor.directory.open_directory).
``--fresh`` is refused with a URL (no rename in an object store: use a new prefix).

``--inprocess`` hands the job to cudasnap.supervisor.inprocess_launch instead: one process per
rank and warm spares, a lost rank taken by a spare while the others keep their process, a
full restart only when no spare is left.

This module owns the command line (:func:`main`: argument parsing, usage errors, the
one-line error); ``cudasnap run`` (cudasnap.tools.cli) and ``python -m
cudasnap.supervisor.run`` call it, and it calls cudasnap.supervisor.loop.supervise.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..config import Settings
from ..errors import ConfigError, SnapshotError
from ..format.paths import is_url
from .loop import supervise

_NO_COMMAND = "no command given (usage: cudasnap run [options] -- cmd ...)"


class UsageExit(SystemExit):
    """Exit status 2 (a usage error), its message kept for callers of :func:`main`."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cudasnap run", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=Settings.from_env().directory or "ckpt",
                   help="snapshot directory or object-store URL (exported as CUDASNAP_DIR)")
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
    g = p.add_argument_group("in-process restart (cudasnap.supervisor.inprocess_launch)")
    g.add_argument("--inprocess", action="store_true",
                   help="one process per rank plus warm spares; a lost rank is taken by a "
                        "spare while the others keep their process")
    g.add_argument("--nproc", type=int, default=1, help="ranks of the job (with --inprocess)")
    g.add_argument("--spares", type=int, default=1, help="warm spare processes")
    g.add_argument("--uids", default=None, help="A-B: the processes this launcher starts "
                   "(several nodes; ranks are 0..nproc-1, spares the rest)")
    g.add_argument("--control", default=None, help="HOST:PORT of the job's control store "
                   "(several nodes; default: hosted here)")
    g.add_argument("--host-control", action="store_true", help="host --control's store here")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command ...")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:  # a usage error: exit 2 with the usage, as argparse does
        p.print_usage(sys.stderr)
        sys.stderr.write(f"cudasnap run: error: {_NO_COMMAND}\n")
        raise UsageExit(_NO_COMMAND)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cudasnap-run %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)  # (--dir s3://: "Found credentials")
    try:
        if a.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, not {a.max_restarts}")
        if a.watchdog is not None and not a.watchdog > 0:
            raise ConfigError(f"--watchdog must be a positive number of seconds, not {a.watchdog}")
        directory: Path | str = a.dir if is_url(a.dir) else Path(a.dir)  # keep s3:// whole
        if a.inprocess:
            from .inprocess_launch import Layout, launch

            lay = Layout.parse(a.nproc, a.spares, a.uids)
            return launch(cmd, directory, lay, max_restarts=a.max_restarts,
                          control=a.control, host_control=a.host_control)
        return supervise(cmd, directory, max_restarts=a.max_restarts, inject_first=a.inject,
                         watchdog_s=a.watchdog, auto=a.auto, fresh=a.fresh,
                         warm=not a.no_warm)
    except (SnapshotError, OSError) as e:
        if a.debug:
            raise
        sys.stderr.write(f"cudasnap run: error: {e}\n")  # the CLI's one-line error
        return 2


if __name__ == "__main__":
    sys.exit(main())
