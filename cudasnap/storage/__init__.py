"""Snapshot storage: where committed snapshots live (the shape of DCP's StorageWriter/Reader).

``open_storage(directory)`` returns the backend for a directory:

* ``PosixStorage`` (``posix.py``): a local path, the default. Its data path is
  the C++ flusher; the commit is a directory rename (single rank) or the COMMIT
  marker (multi-rank), both with fsyncs.
* ``FsspecStorage`` (``fsspec.py``): any fsspec URL (``s3://bucket/prefix``).
  Data objects, then the manifest, then the COMMIT object.

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
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot
from ..format.paths import MANIFEST, is_url, rank_dirname
from . import listing, posix
from .types import FlushResult

log = logging.getLogger("cudasnap")

if TYPE_CHECKING:  # type-only: importing cudasnap.storage loads neither torch nor _C
    import torch

    from cudasnap._C import Arena, FileReadAhead

    from ..format.manifest import Manifest
    from .fsspec import FsspecStorage, RemoteSnapshot, SnapshotRef


class StorageWriter(Protocol):
    local_dir: Path

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None, timeout: float | None = None
                   ) -> tuple[Path | str, FlushResult]:
        """Stores a leased COMPLETE arena slot durably and commits it; (location, stats).
        ``timeout`` (``Snapshotter.flush``'s): bound of the waits on other writers (the
        ``latest`` pointer's lock or compare-and-swap); past it ``latest`` stays as it is
        (the step is committed either way). The write itself is never cut short."""

    def clean_partial(self) -> list[Path] | list[str]:
        """Removes what interrupted flushes left; returns what it removed."""


class StorageReader(Protocol):
    local_dir: Path

    def list_snapshots(self) -> list[posix.StoredSnapshot] | list[RemoteSnapshot]:
        """Committed snapshots, newest first (no validation)."""

    def load_manifest(self, ref: SnapshotRef, *, allow_foreign_owner: bool | None = None
                      ) -> Manifest:
        """The validated manifest of ``ref`` (nothing of its data read yet)."""

    def read_data(self, ref: SnapshotRef, manifest: Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> torch.Tensor:
        """The data of ``ref`` as a uint8 tensor, every chunk CRC-verified."""

    def progress_evidence(self) -> str | None:
        """What says the job made progress here (flush log, step directories, ``latest``),
        or None (``listing.progress_evidence``)."""

    def has_step(self, step: int) -> bool:
        """A committed snapshot of ``step`` is stored here."""

    def read_ahead(self, ref: SnapshotRef, allow_foreign_owner: bool | None = None
                   ) -> FileReadAhead | None:
        """The head of ``ref``'s data read on a native thread while its manifest is loaded
        (pass it to ``open_data``); None where the storage has no such reader."""

    def open_data(self, ref: SnapshotRef, manifest: Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None,
                  ahead: FileReadAhead | None = None) -> posix.DataFile | torch.Tensor:
        """What a restore into the live state applies (``core.restore.Restorer.restore_dir``):
        a local snapshot's data.bin opened and checked but not read (a ``posix.DataFile``:
        ``TrainingState.apply`` reads it chunk by chunk into the live tensors, each chunk
        CRC32C-checked before any byte of it is copied), or ``read_data``'s verified tensor
        (an object store). ``ahead``: this snapshot's ``read_ahead`` (the DataFile takes it
        over)."""


class PosixStorage:
    """StorageWriter and StorageReader of a local directory (``cudasnap.storage.posix``)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.local_dir = posix.check_directory(Path(directory))
        self.url = str(self.local_dir)

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None, timeout: float | None = None
                   ) -> tuple[Path, FlushResult]:
        return posix.write_slot(arena, slot, self.local_dir, threads=threads, keep=keep,
                                extra_manifest=extra_manifest, timeout=timeout)

    def clean_partial(self) -> list[Path]:
        return posix.clean_partial(self.local_dir)

    def list_snapshots(self) -> list[posix.StoredSnapshot]:
        return posix.list_snapshots(self.local_dir)

    def progress_evidence(self) -> str | None:
        return listing.progress_evidence(self.local_dir, posix.list_snapshots(self.local_dir))

    @staticmethod
    def _local(ref: SnapshotRef) -> posix.StoredSnapshot:
        if not isinstance(ref, posix.StoredSnapshot):
            raise ConfigError(f"{ref.path} is not a local snapshot: a local directory's storage "
                              "cannot read it")
        return ref

    def load_manifest(self, ref: SnapshotRef, *, allow_foreign_owner: bool | None = None
                      ) -> Manifest:
        return posix.load_manifest(self._local(ref).manifest_path,
                                   allow_foreign_owner=allow_foreign_owner)

    def read_data(self, ref: SnapshotRef, manifest: Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> torch.Tensor:
        return posix.read_data(self._local(ref).path, manifest, threads,
                               allow_foreign_owner=allow_foreign_owner)

    def has_step(self, step: int) -> bool:
        return any(s.step == step for s in posix.list_snapshots(self.local_dir))

    def read_ahead(self, ref: SnapshotRef, allow_foreign_owner: bool | None = None
                   ) -> FileReadAhead | None:
        return posix.read_ahead(self._local(ref).path, allow_foreign_owner)

    def open_data(self, ref: SnapshotRef, manifest: Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None,
                  ahead: FileReadAhead | None = None) -> posix.DataFile:
        return posix.DataFile(self._local(ref).path, manifest, threads,
                              allow_foreign_owner=allow_foreign_owner, ahead=ahead)


def clean_partial(storage: StorageWriter) -> None:
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
    if not posix.is_committed(path):
        raise CorruptSnapshot(f"{path}: multi-rank snapshot without a COMMIT marker")
    commit = posix.read_commit(path)
    if len(commit.get("replica_groups") or []) != 1:
        raise IncompatibleSnapshot(
            f"{path} holds sharded state of {commit['world_size']} ranks; restore it with "
            f"torch.distributed and {commit['world_size']} ranks")
    for r in commit.get("present", range(commit["world_size"])):
        d = path / rank_dirname(int(r))
        if (d / MANIFEST).is_file():
            return posix.StoredSnapshot(step, d)
    raise CorruptSnapshot(f"{path}: no rank's files are present")


def open_storage(directory: str | os.PathLike[str]) -> PosixStorage | FsspecStorage:
    """The storage of ``directory``: FsspecStorage for a URL, PosixStorage otherwise."""
    if is_url(directory):
        from .fsspec import FsspecStorage

        st = FsspecStorage(str(directory))
        st.check()
        st.share_id()
        return st
    return PosixStorage(directory)


if TYPE_CHECKING:  # mypy proves both storages satisfy both protocols (nothing runs)
    def _conforms(p: PosixStorage, f: FsspecStorage
                  ) -> tuple[StorageWriter, StorageReader, StorageWriter, StorageReader]:
        return p, p, f, f
