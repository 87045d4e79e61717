"""Who owns a snapshot directory, and its ``latest`` pointer.

Owns ``check_directory`` (create the directory 0700, parents too, and prove it writable),
``DirectoryLock`` (one job per directory: an flock of ``DIR/.lock`` naming its owner; a dead
owner's lock is taken over), ``replace_latest`` (point ``DIR/latest`` at a step directory
atomically; it never moves back, under an flock of ``DIR/.latest-lock``) and ``read_latest``.

Call order: ``PosixStorage`` (and the fsspec backend's local cache) calls ``check_directory``
once, when opened; the Snapshotter and ``cudasnap run``'s supervisor take a ``DirectoryLock``
at start and release it at the end; ``posix.write_slot`` calls ``replace_latest`` after a step
directory is renamed into place and fsync'd (the test point ``latest`` is reached between the
write of the new pointer and its rename); ``listing.prune`` and the command line's
listing call ``read_latest`` (restore never needs it). Re-exported by ``cudasnap.storage.posix``.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from ..errors import ConfigError, SnapshotError
from ..format.commit import MAX_LATEST_BYTES, decode_latest, encode_latest
from ..format.paths import LATEST, parse_step_dirname, step_dirname
from .safe_io import _read_regular, _write_file_durable

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


LATEST_LOCK = ".latest-lock"


def replace_latest(directory: Path, name: str, timeout: float | None = None) -> bool:
    """Points ``latest`` at step directory ``name`` atomically (write, fsync, rename, fsync).

    ``timeout``: how long to wait for ``DIR/.latest-lock`` (another writer's flush holds it
    while it replaces ``latest``); past it ``latest`` is left as it is (False, logged): the
    step is committed anyway, and a restore finds it by listing. None: no bound.

    ``latest`` never moves back: when it names a step directory that still exists
    with a higher step, it is left alone (False). Two writers can finish out of
    order: ``cudasnap run``'s flush of the dead attempt's step N ends after the
    restarted attempt flushed N+3. The read-compare-replace runs under an flock of
    ``DIR/.latest-lock``, so neither writer can slip in between.
    """
    new_step = parse_step_dirname(name)
    fd = os.open(directory / LATEST_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not _lock(fd, timeout):
            log.warning("latest not pointed at %s: %s stayed locked by another writer for "
                        "%.1f s (the flush's timeout); the step is committed and a restore "
                        "finds it by listing", name, directory / LATEST_LOCK, timeout)
            return False
        cur = read_latest(directory)
        cur_step = parse_step_dirname(cur) if cur else None
        if (cur_step is not None and new_step is not None and cur_step > new_step
                and (directory / step_dirname(cur_step)).is_dir()):
            log.info("latest stays at %s (newer than %s, which was flushed after it)", cur, name)
            return False
        tmp = directory / f".{LATEST}.tmp-{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            _write_file_durable(tmp, encode_latest(name))
            kill_point("latest")
            os.replace(tmp, directory / LATEST)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        native().fsync_dir(str(directory))
        return True
    finally:
        os.close(fd)  # releases the flock


def read_latest(directory: Path) -> str | None:
    try:
        raw, _ = _read_regular(Path(directory) / LATEST, MAX_LATEST_BYTES, "latest pointer")
    except SnapshotError:
        return None
    return decode_latest(raw)


def _lock(fd: int, timeout: float | None) -> bool:
    """An exclusive flock of ``fd``: blocking (``timeout`` None), else polled until then."""
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
