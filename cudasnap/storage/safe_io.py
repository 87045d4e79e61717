"""Safe small-file I/O of a snapshot directory, and the owner check of what a restore reads.

Owns ``_read_regular`` (a bounded read of a small file that never follows a symlink nor
blocks on a FIFO), ``_write_file_durable`` (create, write and fsync a new file; errors name
it), ``replace_private`` (a small local record replaced atomically, 0600), ``_check_trust``
(files of another user are refused unless ``allow_foreign_owner`` or
``CUDASNAP_ALLOW_FOREIGN_OWNER=1``; group/other-writable ones load with a warning) and
``FOREIGN_ENV``. No policy of its own: the modules of the POSIX and object-store backends
call these.

Call order: ``posix.load_manifest`` / ``posix.read_data`` (restore) call ``_check_trust``
after ``_read_regular`` / ``lstat``; ``latest.read_latest``, ``listing.read_commit`` and
``listing.read_flush_log`` read with ``_read_regular``; ``posix.write_slot`` (the manifest),
``latest.replace_latest`` and ``listing.write_commit`` write with ``_write_file_durable``
(then rename into place).
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from ..config import allowed
from ..errors import ConfigError, CorruptSnapshot

log = logging.getLogger("cudasnap.storage.posix")  # one logger for the POSIX backend


FOREIGN_ENV = "CUDASNAP_ALLOW_FOREIGN_OWNER"


def _allow_foreign(allow: bool | None) -> bool:
    """``allow``, else (a caller that did not say: the offline tools) the process's switch
    (the Snapshotter passes its resolved option)."""
    if allow is not None:
        return bool(allow)
    return allowed(FOREIGN_ENV)


def _check_trust(path: Path, st: os.stat_result, allow_foreign_owner: bool | None) -> None:
    """Refuses files of another user (unless allowed); warns about group/other-writable ones."""
    uid = os.geteuid()
    if st.st_uid != uid and not _allow_foreign(allow_foreign_owner):
        raise ConfigError(
            f"{path} is owned by uid {st.st_uid}, not by this process (uid {uid}); refusing to "
            f"restore a snapshot another user could have written. Check it, then chown it or "
            f"pass allow_foreign_owner=True (or set {FOREIGN_ENV}=1)")
    if st.st_mode & 0o022:
        log.warning("%s has mode %o: writable by group/others, so its content may have been "
                    "altered by another user (checksums catch damage, not forgery)", path,
                    stat.S_IMODE(st.st_mode))


def _read_regular(path: Path, limit: int, what: str) -> tuple[bytes, os.stat_result]:
    """Reads a small regular file without following symlinks or blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise CorruptSnapshot(f"{path} is a symbolic link; a {what} never is") from e
        raise CorruptSnapshot(f"cannot read {path}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptSnapshot(f"{path} is not a regular file")
        if st.st_size > limit:
            raise CorruptSnapshot(f"{path} is {st.st_size} bytes, larger than any {what}")
        chunks = []
        left = limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise CorruptSnapshot(f"cannot read {path}: {e}") from e
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:
        raise CorruptSnapshot(f"{path} grew past {limit} bytes while being read")
    return raw, st


def replace_private(path: Path, raw: bytes) -> None:
    """``path`` replaced atomically by ``raw``, mode 0600, through a temporary name of its
    own (several processes of a host may replace it at once: the last rename wins). No
    fsync: for local records rebuilt when lost (an object store's index, its id copy, the
    URL marker of its state directory)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)


def _write_file_durable(path: Path, data: bytes) -> None:
    """Creates ``path`` (0600, must not exist), writes and fsyncs it; errors name the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except OSError as e:  # os.write/fsync errors carry no file name (disk full: which file?)
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)
