"""A snapshot directory's ``latest`` pointer.

Owns ``replace_latest`` (point ``DIR/latest`` at a step directory atomically; it never moves
back, under an flock of ``DIR/.latest-lock``) and ``read_latest``. Who owns the directory
(``check_directory``, ``DirectoryLock``) is ``cudasnap.storage.ownership``'s.

Call order: ``posix.write_slot`` (and a multi-rank round's commit) calls ``replace_latest`` after
a step directory is renamed into place and fsync'd (the test point ``latest`` is reached
between the write of the new pointer and its rename); ``listing.prune`` and the command line's
listing call ``read_latest`` (restore never needs it).
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from ..errors import SnapshotError
from ..format.commit import MAX_LATEST_BYTES, decode_latest, encode_latest
from ..format.paths import LATEST, parse_step_dirname, step_dirname
from .safe_io import _read_regular, _write_file_durable

log = logging.getLogger("cudasnap.storage.posix")  # one logger for the POSIX backend


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
