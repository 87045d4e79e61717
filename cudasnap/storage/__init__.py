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
``open_data(storage, ref, ...)`` is what a restore into the live state reads: a local
snapshot's ``posix.DataFile`` (read chunk by chunk into the live tensors), else
``storage.read_data``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from ..format.paths import is_url
from . import listing, posix
from .types import FlushResult

if TYPE_CHECKING:  # type-only: importing cudasnap.storage loads neither torch nor _C
    import torch

    from cudasnap._C import Arena, FileReadAhead

    from ..format.manifest import Manifest
    from .fsspec import FsspecStorage, RemoteSnapshot, SnapshotRef


class StorageWriter(Protocol):
    local_dir: Path

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None
                   ) -> tuple[Path | str, FlushResult]:
        """Stores a leased COMPLETE arena slot durably and commits it; (location, stats)."""

    def clean_partial(self) -> list[Path] | list[str]:
        """Removes what interrupted flushes left; returns what it removed."""


class StorageReader(Protocol):
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


class PosixStorage:
    """StorageWriter and StorageReader of a local directory (``cudasnap.storage.posix``)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.local_dir = posix.check_directory(Path(directory))
        self.url = str(self.local_dir)

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None) -> tuple[Path, FlushResult]:
        return posix.write_slot(arena, slot, self.local_dir, threads=threads, keep=keep,
                                extra_manifest=extra_manifest)

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


def read_ahead(storage: StorageReader, ref: SnapshotRef,
               allow_foreign_owner: bool | None = None) -> FileReadAhead | None:
    """For a local snapshot of a ``PosixStorage``: its data.bin's head read on a native
    thread while the manifest is loaded (``posix.read_ahead``; pass it to ``open_data``);
    None for any other storage."""
    if isinstance(storage, PosixStorage) and isinstance(ref, posix.StoredSnapshot):
        return posix.read_ahead(ref.path, allow_foreign_owner)
    return None


def open_data(storage: StorageReader, ref: SnapshotRef, manifest: Manifest, threads: int = 4, *,
              allow_foreign_owner: bool | None = None,
              ahead: FileReadAhead | None = None) -> posix.DataFile | torch.Tensor:
    """What a restore into the live state applies (``core.restore.Restorer.restore_dir``):
    for a local snapshot of a ``PosixStorage`` its data.bin opened and checked but not read
    (a ``posix.DataFile``: ``TrainingState.apply`` reads it chunk by chunk into the live
    tensors, each chunk CRC32C-checked before any byte of it is copied); for any other
    storage (an object store: ``FsspecStorage``, whose local paths name remote objects too)
    ``storage.read_data(...)``, the whole data verified in a new tensor. ``ahead``: this
    snapshot's ``read_ahead`` (the DataFile takes it over)."""
    if isinstance(storage, PosixStorage) and isinstance(ref, posix.StoredSnapshot):
        return posix.DataFile(ref.path, manifest, threads, allow_foreign_owner=allow_foreign_owner,
                              ahead=ahead)
    return storage.read_data(ref, manifest, threads, allow_foreign_owner=allow_foreign_owner)


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
