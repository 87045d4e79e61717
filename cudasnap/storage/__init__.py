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
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from ..format.paths import is_url
from . import posix


class SnapshotRef(Protocol):
    step: int

    @property
    def path(self) -> Any: ...


class StorageWriter(Protocol):
    local_dir: Path

    def write_slot(self, arena: Any, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Stores a leased COMPLETE arena slot durably and commits it; (location, stats)."""

    def clean_partial(self) -> list[Any]:
        """Removes what interrupted flushes left; returns what it removed."""


class StorageReader(Protocol):
    def list_snapshots(self) -> list[Any]:
        """Committed snapshots, newest first (no validation)."""

    def load_manifest(self, ref: Any, *, allow_foreign_owner: bool | None = None
                      ) -> dict[str, Any]:
        """The validated manifest of ``ref`` (nothing of its data read yet)."""

    def read_data(self, ref: Any, manifest: dict[str, Any], threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> Any:
        """The data of ``ref`` as a uint8 tensor, every chunk CRC-verified."""


class PosixStorage:
    """StorageWriter and StorageReader of a local directory (``cudasnap.storage.posix``)."""

    def __init__(self, directory: str | os.PathLike[Any]) -> None:
        self.local_dir = posix.check_directory(Path(directory))
        self.url = str(self.local_dir)

    def write_slot(self, arena: Any, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any]]:
        return posix.write_slot(arena, slot, self.local_dir, threads=threads, keep=keep,
                                extra_manifest=extra_manifest)

    def clean_partial(self) -> list[Path]:
        return posix.clean_partial(self.local_dir)

    def list_snapshots(self) -> list[posix.StoredSnapshot]:
        return posix.list_snapshots(self.local_dir)

    def load_manifest(self, ref: posix.StoredSnapshot, *, allow_foreign_owner: bool | None = None
                      ) -> dict[str, Any]:
        return posix.load_manifest(ref.manifest_path, allow_foreign_owner=allow_foreign_owner)

    def read_data(self, ref: posix.StoredSnapshot, manifest: dict[str, Any], threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> Any:
        return posix.read_data(ref.path, manifest, threads, allow_foreign_owner=allow_foreign_owner)


def open_storage(directory: str | os.PathLike[Any]) -> Any:
    """The storage of ``directory``: FsspecStorage for a URL, PosixStorage otherwise."""
    if is_url(directory):
        from .fsspec import FsspecStorage

        st = FsspecStorage(str(directory))
        st.check()
        return st
    return PosixStorage(directory)
