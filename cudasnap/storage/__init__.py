"""Snapshot storage: where committed snapshots live (the shape of DCP's StorageWriter/Reader).

One seam, ``Storage`` (``protocol.py``), serves one rank and many; ``open_storage(directory)``
(``registry.py``: backends by URL scheme) returns the backend for a directory:

* ``PosixStorage`` (``posix.py``): a local path, the default. Its data path is
  the C++ flusher; the commit is a directory rename (single rank) or the COMMIT
  marker (multi-rank), both with fsyncs.
* ``FsspecStorage`` (``fsspec.py``): any fsspec URL (``s3://bucket/prefix``).
  Data objects, then the manifest, then the COMMIT object.
* the others ``registry.SCHEMES`` names.

Both follow the names and records of ``cudasnap.format``; both list committed
snapshots only and verify every manifest and chunk on read. ``local_dir`` is
the host-local directory holding the lock, the directory id and the flush log.
``storage.open_data(ref, ...)`` is what a restore into the live state reads: a local
snapshot's ``posix.DataFile`` (read chunk by chunk into the live tensors), else the
verified data of ``storage.read_data``; ``storage.has_step(step)`` says whether a step is
committed there (an object store's listing for a URL, never a local path).
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CorruptSnapshot, IncompatibleSnapshot
from ..format.paths import MANIFEST, rank_dirname
from . import listing, posix
from .posix import PosixStorage
from .protocol import Storage
from .registry import open_storage, url_of
from .types import FlushResult

log = logging.getLogger("cudasnap")

def clean_partial(storage: Storage) -> None:
    """What interrupted flushes left in ``storage`` removed, and said (a WARNING)."""
    removed = storage.clean_partial()
    if removed:
        log.warning("removed %d interrupted flush(es): %s", len(removed),
                    ", ".join(str(p).rstrip("/").rsplit("/", 1)[-1] for p in removed))


def is_local(ref: object) -> bool:
    """``ref`` names a snapshot of a local directory."""
    return isinstance(ref, posix.StoredSnapshot)


def local_snapshot(path: Path, step: int = -1) -> posix.StoredSnapshot:
    """A local step or rank directory as a snapshot reference; a multi-rank step directory
    opened by one process: the files of one of its ranks, when its state is replicated
    (IncompatibleSnapshot for sharded state)."""
    if (path / MANIFEST).exists() or not any(path.glob("rank-*")):
        return posix.StoredSnapshot(step, path)
    if not listing.is_committed(path):
        raise CorruptSnapshot(f"{path}: multi-rank snapshot without a COMMIT marker")
    commit = listing.read_commit(path)
    if len(commit.get("replica_groups") or []) != 1:
        raise IncompatibleSnapshot(
            f"{path} holds sharded state of {commit['world_size']} ranks; restore it with "
            f"torch.distributed and {commit['world_size']} ranks")
    for r in commit.get("present", range(commit["world_size"])):
        d = path / rank_dirname(int(r))
        if (d / MANIFEST).is_file():
            return posix.StoredSnapshot(step, d)
    raise CorruptSnapshot(f"{path}: no rank's files are present")


__all__ = ["FlushResult", "PosixStorage", "Storage", "clean_partial", "is_local", "local_snapshot",
           "open_storage", "url_of"]
