"""The one storage seam: where committed snapshots live, for one rank and for many.

``Storage`` is DCP's ``StorageWriter`` and ``StorageReader`` in one protocol. Every backend
(``storage.registry`` names them by URL scheme) implements all of it; the Snapshotter, the
flush of ``cudasnap run``, the distributed flush round and the command line hold a
``Storage`` and never ask which backend it is.

Call order:

* **open**: ``registry.open_storage(directory)`` (or a ``Storage`` made by the caller and
  passed to the Snapshotter as ``directory``); the Snapshotter then calls ``clean_partial``
  once, holding ``local_dir``'s lock (``storage.ownership.DirectoryLock``).
* **one rank writes**: ``write_slot`` (the data, the manifest, the commit, ``latest``, the
  prune; in one call, as DCP's ``write_data`` + ``finish`` of one rank).
* **many ranks write** (``cudasnap.distributed.flush_round``, one round): each writer
  ``clear_stale`` then ``write_rank`` (DCP's ``write_data``: its part, ``step-N/rank-R``);
  the committer ``present`` then ``commit`` (DCP's ``finish``: the COMMIT record, then
  ``latest``, then the prune); every rank ``refresh`` after a committed round;
  ``committed_with`` says whether a step was committed with a rank's part.
* **read**: ``list_snapshots`` (newest first) -> ``read_ahead`` (optional) ->
  ``load_manifest`` -> ``open_data`` (what the restore copies from) or ``read_data`` (the
  whole data, verified); ``has_step`` and ``progress_evidence`` answer the resume checks.

Every read is verified (the manifest's checks, each data chunk's CRC32C) before a byte of
it reaches a live tensor; a write never leaves a half-written step that a reader lists.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from .types import FlushResult

if TYPE_CHECKING:  # type-only: importing cudasnap.storage loads neither torch nor _C
    import torch

    from cudasnap._C import Arena, FileReadAhead

    from ..config import Settings
    from ..format.manifest import Manifest
    from .listing import StoredSnapshot
    from .remote_base import RemoteSnapshot

    SnapshotRef: TypeAlias = StoredSnapshot | RemoteSnapshot


class Storage(Protocol):
    url: str  # what the user named (a path, or a URL); logs and errors say it
    local_dir: Path  # this host's directory of the lock, the directory id and the flush log

    @classmethod
    def open(cls, directory: str, settings: Settings) -> Storage:
        """The storage of ``directory`` (its scheme's, ``storage.registry``), checked before
        anything is written (ConfigError: a missing bucket, a directory not writable);
        ``settings``: the entry point's (``config.Settings``: a backend reads no environment)."""

    # ------------------------------------------------------------------ one rank
    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None, timeout: float | None = None
                   ) -> tuple[Path | str, FlushResult]:
        """Stores a leased COMPLETE arena slot durably and commits it; (location, stats).
        ``timeout`` (``Snapshotter.flush``'s): bound of the waits on other writers (the
        ``latest`` pointer's lock or compare-and-swap); past it ``latest`` stays as it is
        (the step is committed either way). The write itself is never cut short."""

    def clean_partial(self) -> list[Path] | list[str]:
        """Removes what interrupted flushes left; returns what it removed."""

    # ------------------------------------------------------------------ many ranks
    def clear_stale(self, step: int, rank: int) -> None:
        """Removes ``rank``'s part of an uncommitted ``step`` (a failed round's)."""

    def write_rank(self, arena: Arena, slot: int, rank: int, *, threads: int,
                   extra_manifest: dict[str, Any]) -> Path:
        """Writes ``rank``'s part of the leased slot's step (not committed); its path under
        ``local_dir`` (the local index's, for an object store)."""

    def present(self, step: int, world: int) -> list[int]:
        """Ranks whose part of ``step`` is complete."""

    def commit(self, step: int, record: dict[str, Any], keep: int,
               timeout: float | None = None) -> None:
        """``COMMIT`` of ``step``, then ``latest``, then prune to ``keep``; ``timeout``:
        the wait for ``latest`` (its lock, its compare-and-swap) ends by then, leaving
        ``latest`` as it is (the step is committed: a restore finds it by listing)."""

    def committed_with(self, step: int, rank: int) -> bool:
        """``step`` is committed with ``rank``'s part."""

    def refresh(self) -> None:
        """After a committed round (an object store's local index)."""

    # ------------------------------------------------------------------ read
    def list_snapshots(self) -> list[StoredSnapshot] | list[RemoteSnapshot]:
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
                  ahead: FileReadAhead | None = None) -> Any:
        """What a restore into the live state copies from (``core.restore.Restorer``): a
        ``posix.DataFile`` (not named here: the backends import this module), a
        local snapshot's data file opened and checked but not read (each chunk is CRC32C-
        checked before any byte of it is copied), or ``read_data``'s verified tensor (an
        object store). ``ahead``: this snapshot's ``read_ahead`` (the data file takes it
        over)."""


__all__ = ["Storage"]
