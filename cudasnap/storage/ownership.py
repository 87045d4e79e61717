"""Who owns a snapshot directory: its creation and its lock.

Owns ``check_directory`` (create the directory 0700, parents too, and prove it writable) and
``DirectoryLock`` (one job per directory: an flock of ``DIR/.lock`` naming its owner; a dead
owner's lock is taken over).

Call order: ``PosixStorage`` (and the fsspec backend's local cache) calls ``check_directory``
once, when opened; the Snapshotter and ``cudasnap run``'s supervisor take a ``DirectoryLock``
at start and release it at the end.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("cudasnap.storage.posix")  # one logger for the POSIX backend


def check_directory(directory: Path) -> Path:
    """Creates ``directory`` (0700) if needed and proves it is writable now."""
    directory = Path(directory)
    try:
        # Parents too are created 0700 (Path.mkdir gives them 0777 & ~umask: 0777 under umask 0).
        missing = []
        p = directory
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        for p in reversed(missing):
            p.mkdir(mode=0o700, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"ok")
        os.fsync(fd)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"snapshot directory {directory} is not writable: {e}") from e
    return directory


class DirectoryLock:
    """Exclusive lock of a snapshot directory: one job per directory.

    The lock file holds the owner's pid and host. flock() is released by the
    kernel when the owner dies, so a stale lock is taken over (with a warning
    naming the dead owner) without any pid guessing. ``supervised``: under
    ``cudasnap run``, whose restart after a death is the expected case, the takeover
    is logged at INFO.
    """

    def __init__(self, directory: Path, rank: int = 0, supervised: bool = False) -> None:
        self.path = Path(directory) / (".lock" if rank == 0 else f".lock-rank{rank}")
        self._fd: int | None = None
        self._supervised = supervised

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(
                f"snapshot directory {self.path.parent} is in use by another job ({owner}); "
                "use another directory or stop that job") from None
        previous = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if previous:
            log.log(logging.INFO if self._supervised else logging.WARNING,
                    "taking over stale lock %s left by %s", self.path, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
