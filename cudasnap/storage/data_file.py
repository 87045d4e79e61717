"""A local snapshot's data.bin, opened and checked but not read: the restore's byte source.

``PosixStorage.open_data`` hands a ``DataFile`` to the restore (``core.restore.Restorer``):
a record of the open file (descriptor, path, size, chunk size, the manifest's CRC32C list,
the read-ahead of its head, the read settings) that holds no copy logic. The restore plans
the copies and reads the file itself (``cudasnap.core.file_copy``: every chunk's CRC32C is
checked by the native reader before any byte of it is copied), so the path goes down only:
core -> storage (open, check) -> the record back -> core (plan, copy) -> native.

The checks (``read_data``'s too, ``storage.posix``): the file is opened without following
symlinks and must be the regular file ``lstat`` saw, of this user's (``_check_trust``),
of the manifest's size, all checked on the open file too.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CorruptSnapshot
from ..format import manifest as fmt
from ..format.paths import DATA
from .safe_io import _check_trust

if TYPE_CHECKING:
    from cudasnap._C import FileReadAhead

log = logging.getLogger("cudasnap.storage.posix")

# The fused restore's reads (core.file_copy; bench/snapshot_cpu.py --restore-only measures
# them): bytes per read (0: one chunk) and O_DIRECT. One chunk per read through the page cache
# measured fastest on the bench VM (issue 26; O_DIRECT and 2-4 chunk reads were no faster).
SCATTER_IO_BYTES = 0
SCATTER_DIRECT = False


def _lstat_data(path: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:  # torn (e.g. a prune killed half-way): skip it, don't fail restore
        raise CorruptSnapshot(f"{path} is missing (the snapshot is incomplete)") from None
    except OSError as e:
        raise CorruptSnapshot(f"cannot stat {path}: {e}") from e


def _check_data_file(path: Path, st: os.stat_result, nbytes: int,
                     allow_foreign_owner: bool | None) -> None:
    """data.bin's checks before a byte is read: a regular file of this user's (``_check_trust``)
    of the manifest's size."""
    if not stat.S_ISREG(st.st_mode):
        raise CorruptSnapshot(f"{path} is not a regular file")
    _check_trust(path, st, allow_foreign_owner)
    if st.st_size != nbytes:
        raise CorruptSnapshot(f"{path} is {st.st_size} bytes, the manifest says {nbytes} "
                              "(truncated or replaced)")


class DataFile:
    """A snapshot's data.bin, opened and checked but not read (``PosixStorage.open_data``).

    What the restore reads it with (``cudasnap.core.file_copy``): ``fd`` (the open file the
    checks ran on), ``path`` (for messages), ``nbytes``, ``chunk_bytes``, ``crcs`` (one
    CRC32C per chunk, the manifest's), ``threads``, ``io_bytes`` / ``direct`` (the read
    settings) and ``ahead``: a ``posix.read_ahead`` of this snapshot, started before the
    manifest was read, whose bytes the reader takes instead of reading them again (checked
    the same way, and only if it read this very file). ``stop_ahead`` stops it and frees
    its buffer (the reader calls it once read); so does ``close``. Close it (``close``, or
    ``with``) when done; the restore closes it once read.
    """

    def __init__(self, snapshot_dir: Path, manifest: fmt.Manifest, threads: int = 4, *,
                 allow_foreign_owner: bool | None = None,
                 ahead: FileReadAhead | None = None) -> None:
        self.fd = -1
        self.ahead = ahead
        data = manifest["data"]
        if data.get("file") != DATA:  # validate_manifest refuses it; never a path from JSON
            raise CorruptSnapshot(f"{snapshot_dir}: data file must be {DATA!r}")
        self.path = Path(snapshot_dir) / DATA
        self.nbytes = int(data["bytes"])
        self.chunk_bytes = int(data["chunk_bytes"])
        self.crcs = [int(c) for c in data["crc32c"]]
        self.threads = max(1, int(threads))
        self.io_bytes = SCATTER_IO_BYTES
        self.direct = SCATTER_DIRECT
        before = _lstat_data(self.path)
        _check_data_file(self.path, before, self.nbytes, allow_foreign_owner)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                              | os.O_NONBLOCK)
        except FileNotFoundError:
            raise CorruptSnapshot(f"{self.path} is missing (the snapshot is incomplete)") from None
        except OSError as e:  # ELOOP: a symlink planted since the lstat
            raise CorruptSnapshot(f"cannot open {self.path}: {e}") from e
        try:
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise CorruptSnapshot(f"{self.path} was replaced while it was being opened")
            _check_data_file(self.path, st, self.nbytes, allow_foreign_owner)
        except BaseException:
            self.close()
            raise

    def stop_ahead(self) -> None:
        """Stops the read-ahead (if any) and frees its buffer."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.finish()
            if ahead.error:
                log.debug("read-ahead of %s stopped at byte %d: %s", self.path, ahead.held,
                          ahead.error)
            ahead.release()

    def close(self) -> None:
        self.stop_ahead()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> DataFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
