"""Facts about processes of this host, from the kernel (no CUDA, no torch)."""
from __future__ import annotations

import os
from collections.abc import Callable


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host and has not ended (another user's
    counts). A zombie (SIGKILLed, not yet reaped by its parent) has ended: it holds no
    lock, arena or socket (an in-process restart's spare adopts its arena at once)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it exists


def process_start_time(pid: int | None = None) -> float | None:
    """Wall time ``pid`` (default: this process) was started, from /proc (10 ms
    resolution); None where unknown."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int, parent: int, ignore: tuple[int, ...] = ()
                        ) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when ``parent``
    (the process, and the thread, that forks it) dies (Linux ``PR_SET_PDEATHSIG``).

    The parent may die between the fork and the ``prctl`` call; the child then already
    belongs to another parent (init, a subreaper) and sends ``sig`` to itself. Everything
    the child runs is resolved here, in the parent: nothing is imported after the fork.
    Where prctl is not available (not Linux) the function does nothing. ``ignore``:
    signals the child starts with ignored (SIG_IGN survives exec).
    """
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    getppid, kill, getpid = os.getppid, os.kill, os.getpid

    def preexec() -> None:
        for s in ignore:
            signal.signal(s, signal.SIG_IGN)
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if getppid() != parent:
            kill(getpid(), sig)

    return preexec


def ppid_of(pid: int) -> int | None:
    """The parent pid of ``pid`` now (from /proc); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def environ_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (empty where unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out
