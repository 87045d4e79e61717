"""POSIX snapshot storage (local disk): durable, atomic, checksummed, no pickle.

The default backend; its data path is the C++ flusher (``write_slot_file``,
``read_file_verified``). Names come from ``cudasnap.format.paths``. Layout of
a snapshot directory ``DIR``::

    DIR/.lock                     owner pid/host of the job writing here (flock)
    DIR/latest                    text: name of the newest committed step directory
    DIR/step-00000041/            one committed snapshot (a rename made it visible)
        manifest.json             JSON: format, step, rank, tensors, host state, chunk CRCs
        data.bin                  raw bytes, CRC32C per chunk listed in the manifest
    DIR/step-00000042.tmp-<pid>/  a flush in progress (never loaded, removed on start)

Commit protocol (``write_slot``): write data and manifest into the ``.tmp``
directory, fsync both and the directory, rename it to ``step-N``, fsync
``DIR``, then replace ``latest`` atomically (write, fsync, rename, fsync).
A crash at any moment leaves the previous snapshot loadable.

Trust on restore (``load_manifest`` / ``read_data``): files are opened without
following symlinks, must be regular files, are size-checked before any read,
and must belong to this process's user (else ConfigError, unless
``allow_foreign_owner`` or ``CUDASNAP_ALLOW_FOREIGN_OWNER=1``); a snapshot
writable by group/others loads with a warning.

Test-only crash points (``cudasnap._testing.faults.kill_point``): phases
manifest/rename/replace/renamed here, latest in ``latest.replace_latest``.

Split (issue 24, 47): this module is the slot writer (``write_slot``; ``slots.complete_slot``
reads the leased slot, for every backend), ``PosixStorage`` (the backend) and the
reader of one snapshot (``load_manifest``, ``read_data``, ``read_ahead``); the rest of the
backend lives beside it, each name in one home (nothing re-exported for others):
``storage.ownership`` (``check_directory``, ``DirectoryLock``), ``storage.latest``
(``replace_latest``, ``read_latest``), ``storage.listing`` (``StoredSnapshot``,
``list_snapshots``, the COMMIT marker, the flush log, ``prune``), ``storage.partial``
(``clean_partial``), ``storage.data_file`` (``DataFile``). The safe small-file I/O and the
owner check are ``storage.safe_io``'s.

Call order: ``PosixStorage`` (cudasnap.storage), the supervisor's orphan flush, the
distributed flush round and the timeline each call ``posix.write_slot``: ``complete_slot`` ->
data and manifest into ``.tmp`` -> rename -> ``latest.replace_latest`` -> ``listing.prune``
-> ``listing.append_flush_log``. A restore calls ``load_manifest`` then ``read_data``, or opens
a ``DataFile`` (``storage.data_file``; ``PosixStorage.open_data``, for a ``PosixStorage``'s local
snapshot: opened and checked here, read by ``core.file_copy`` chunk by chunk into the live
tensors, issue 26).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from ..config import Settings
from ..errors import ConfigError, CorruptSnapshot, FlushError, SnapshotError
from ..format import manifest as fmt
from ..format.paths import COMMIT, DATA, LATEST, MANIFEST, rank_dirname, step_dirname
from . import listing
from .data_file import DataFile, _check_data_file, _lstat_data
from .latest import replace_latest
from .listing import StoredSnapshot, append_flush_log, list_snapshots, prune, write_commit
from .ownership import check_directory
from .partial import clean_partial
from .safe_io import _check_trust, _read_regular, _write_file_durable
from .slots import complete_slot
from .types import FlushResult

if TYPE_CHECKING:  # type-only: importing this module loads neither torch nor _C
    import torch

    from cudasnap._C import Arena, FileReadAhead, SlotInfo

    from .protocol import SnapshotRef

log = logging.getLogger("cudasnap.storage.posix")


def _copy_at(target: Path, info: SlotInfo, meta: dict[str, Any]) -> bool | None:
    """Is this slot already stored at ``target``: True (this very slot: same seq, same job),
    False (another run's or a corrupt copy of its step), None (nothing there)."""
    if not (target / MANIFEST).exists():
        return None
    try:
        prev = json.loads(_read_regular(target / MANIFEST, fmt.MAX_MANIFEST_BYTES, "manifest")[0])
        return bool(prev.get("slot_seq") == int(info["seq"]) and prev.get("job") == meta.get("job"))
    except (SnapshotError, ValueError, RecursionError, AttributeError):
        return False


def write_slot(arena: Arena, slot: int, directory: Path, *, threads: int = 4,
               io_bytes: int = 16 << 20, keep: int = 3, extra_manifest: dict[str, Any] | None = None,
               subdir: str | None = None, update_latest: bool = True,
               timeout: float | None = None) -> tuple[Path, FlushResult]:
    """Flushes a leased COMPLETE arena slot to ``directory``; returns (path, stats).
    ``timeout``: bound of the wait for the ``latest`` lock (``latest.replace_latest``)."""
    C = native()
    t0 = time.perf_counter()
    info, meta = complete_slot(arena, slot)
    step = int(info["step"])
    directory = Path(directory)
    final = directory / step_dirname(step)
    target = final / subdir if subdir else final
    there = _copy_at(target, info, meta)
    if there:
        log.info("step %d already on disk at %s", step, target)
        return target, {"bytes": 0, "seconds": 0.0, "skipped": True, "step": step}
    # Another run's (or a corrupt) copy of this step: replace it; it is moved
    # aside only once the new copy is complete, then removed.
    stale = target.with_name(f"{target.name}.old-{os.getpid()}") if there is False else None
    # Ranks share the step directory: each writes DIR/step-N/<subdir>.tmp-<pid> and renames
    # it into place; the COMMIT marker (cudasnap.distributed.flush_round) makes the step
    # visible, never the directory itself.
    tmp = final / f"{subdir}.tmp-{os.getpid()}" if subdir else \
        directory / f"{step_dirname(step)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if subdir:
            final.mkdir(mode=0o700, exist_ok=True)
        tmp.mkdir(mode=0o700)
        st = C.write_slot_file(arena, slot, str(tmp / DATA), threads, io_bytes, True)
        body = fmt.stored_manifest(meta, info, arena.chunk_bytes, st["crc32c"], extra_manifest)
        _write_file_durable(tmp / MANIFEST, body)
        kill_point("manifest")
        C.fsync_dir(str(tmp))
        kill_point("rename")
        if stale is not None:
            os.rename(target, stale)
            kill_point("replace")
        os.rename(tmp, target)
        kill_point("renamed")
        C.fsync_dir(str(target.parent))
        if subdir:
            C.fsync_dir(str(directory))
    except (OSError, SnapshotError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale is not None and stale.exists() and not target.exists():
            try:  # the committed copy we moved aside is still the only one: put it back
                os.rename(stale, target)
            except OSError:
                pass  # clean_partial() brings it back at the next start
        if isinstance(e, SnapshotError):
            raise
        raise FlushError(f"flush of step {step} to {directory} failed: {e}") from e
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    if update_latest:
        # The step is committed (renamed, fsync'd); restore never needs `latest`,
        # but a failure here (disk full) must still surface as a FlushError.
        try:
            replace_latest(directory, final.name, timeout)
        except OSError as e:
            raise FlushError(f"step {step} is on disk at {target}, but updating "
                             f"{directory / LATEST} failed: {e}") from e
        prune(directory, keep)
    elapsed = time.perf_counter() - t0
    stats: FlushResult = {"bytes": st["bytes"], "seconds": elapsed, "write_seconds": st["seconds"],
             "fsync_seconds": st["fsync_seconds"], "step": step}
    log.info("flushed step %d: %.1f MB in %.3f s (%.2f GB/s) to %s", step, st["bytes"] / 1e6,
             elapsed, st["bytes"] / max(elapsed, 1e-9) / 1e9, target)
    append_flush_log(directory, {**stats, "pid": os.getpid(), "time": time.time(),
                                  "path": str(target)})
    return target, stats


def load_manifest(path: Path, *, allow_foreign_owner: bool | None = None) -> fmt.Manifest:
    """Reads and validates one manifest; raises CorruptSnapshot / IncompatibleSnapshot.

    The manifest must be a regular file (no symlink, FIFO or device) of this
    user's (see ``_check_trust``), carry its own CRC32C, and pass
    ``validate_manifest`` before anything else is read.
    """
    path = Path(path)
    raw, st = _read_regular(path, fmt.MAX_MANIFEST_BYTES, "manifest")
    try:
        dst = os.lstat(path.parent)
    except OSError as e:
        raise CorruptSnapshot(f"cannot stat {path.parent}: {e}") from e
    _check_trust(path.parent, dst, allow_foreign_owner)
    _check_trust(path, st, allow_foreign_owner)
    return fmt.parse_manifest(raw, str(path))


def read_data(snapshot_dir: Path, manifest: fmt.Manifest, threads: int = 4, *,
              allow_foreign_owner: bool | None = None) -> torch.Tensor:
    """Reads data.bin into a new uint8 tensor, every chunk CRC32C-verified.

    ``manifest`` must have passed ``load_manifest``: the file name is always
    ``data.bin`` (never a name from the manifest), its size must equal the
    manifest's byte count before a byte is read, and every tensor range lies
    inside it.
    """
    import torch

    data = manifest["data"]
    if data.get("file") != DATA:  # validate_manifest refuses it; never trust a path from JSON
        raise CorruptSnapshot(f"{snapshot_dir}: data file must be {DATA!r}")
    path = Path(snapshot_dir) / DATA
    nbytes = int(data["bytes"])
    _check_data_file(path, _lstat_data(path), nbytes, allow_foreign_owner)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    native().read_file_verified(str(path), buf.data_ptr(), nbytes, int(data["chunk_bytes"]),
                                [int(c) for c in data["crc32c"]], threads)
    return buf


# The head of data.bin read on a native thread while the restore lists, parses the manifest
# and plans the copy (``read_ahead``): those ~90 ms at 4,000 tensors no longer wait before the
# first read (issue 26). At most this many bytes (a transient buffer, freed once restored).
READ_AHEAD_BYTES = 256 << 20


def read_ahead(snapshot_dir: Path, allow_foreign_owner: bool | None = None
               ) -> FileReadAhead | None:
    """Starts reading the head of ``snapshot_dir``'s data.bin on a native thread
    (``_C.FileReadAhead``) before its manifest is read; hand it to ``DataFile(ahead=)``.

    Best effort: None where there is no regular data.bin of this user's to read (the
    DataFile's own checks then say what is wrong). Nothing read is trusted before the
    reader (``core.file_copy``) checked each chunk against the manifest's CRC32C, and only
    if it is the very file (device, inode) the DataFile opened. ``release()`` it when done
    (``DataFile.stop_ahead`` does): its buffer is freed then, not when it is collected."""
    if READ_AHEAD_BYTES <= 0:
        return None
    path = Path(snapshot_dir) / DATA
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        _check_trust(path, st, allow_foreign_owner)
        return native().FileReadAhead(fd, READ_AHEAD_BYTES)
    except (SnapshotError, OSError, MemoryError):
        return None
    finally:
        os.close(fd)  # the reader has its own descriptor


class PosixStorage:
    """``storage.protocol.Storage`` of a local (or shared) file-system directory: one
    rank's snapshot is committed by a directory rename, many ranks' by the COMMIT marker
    (``listing.write_commit``), both with fsyncs (the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.local_dir = check_directory(Path(directory))
        self.directory = self.local_dir
        self.url = str(self.local_dir)

    @classmethod
    def open(cls, directory: str, settings: Settings) -> PosixStorage:
        return cls(directory)

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None, timeout: float | None = None
                   ) -> tuple[Path, FlushResult]:
        return write_slot(arena, slot, self.local_dir, threads=threads, keep=keep,
                                extra_manifest=extra_manifest, timeout=timeout)

    def clean_partial(self) -> list[Path]:
        return clean_partial(self.local_dir)

    # ------------------------------------------------------------ many ranks
    def clear_stale(self, step: int, rank: int) -> None:
        step_dir = self.directory / step_dirname(step)
        d = step_dir / rank_dirname(rank)
        if d.exists() and not (step_dir / COMMIT).exists():
            log.warning("removing %s: left by a round that did not commit", d)
            shutil.rmtree(d, ignore_errors=True)

    def write_rank(self, arena: Arena, slot: int, rank: int, *, threads: int,
                   extra_manifest: dict[str, Any]) -> Path:
        path, _ = write_slot(arena, slot, self.directory, threads=threads,
                             subdir=rank_dirname(rank), update_latest=False,
                             extra_manifest=extra_manifest)
        return Path(path)

    def present(self, step: int, world: int) -> list[int]:
        step_dir = self.directory / step_dirname(step)
        return [r for r in range(world) if (step_dir / rank_dirname(r) / MANIFEST).is_file()]

    def commit(self, step: int, record: dict[str, Any], keep: int,
               timeout: float | None = None) -> None:
        step_dir = self.directory / step_dirname(step)
        write_commit(step_dir, record)
        try:
            replace_latest(self.directory, step_dir.name, timeout)
            prune(self.directory, keep)
        except OSError as e:  # committed: `latest` is a hint, the prune runs again next time
            log.warning("step %d is committed in %s, but updating latest/pruning failed: %s",
                        step, self.url, e)

    def committed_with(self, step: int, rank: int) -> bool:
        step_dir = self.directory / step_dirname(step)
        return (step_dir / COMMIT).is_file() and \
            (step_dir / rank_dirname(rank) / MANIFEST).is_file()

    def refresh(self) -> None:
        return None

    # ------------------------------------------------------------ read

    def list_snapshots(self) -> list[StoredSnapshot]:
        return list_snapshots(self.local_dir)

    def progress_evidence(self) -> str | None:
        return listing.progress_evidence(self.local_dir, list_snapshots(self.local_dir))

    @staticmethod
    def _local(ref: SnapshotRef) -> StoredSnapshot:
        if not isinstance(ref, StoredSnapshot):
            raise ConfigError(f"{ref.path} is not a local snapshot: a local directory's storage "
                              "cannot read it")
        return ref

    def load_manifest(self, ref: SnapshotRef, *, allow_foreign_owner: bool | None = None
                      ) -> fmt.Manifest:
        return load_manifest(self._local(ref).manifest_path,
                                   allow_foreign_owner=allow_foreign_owner)

    def read_data(self, ref: SnapshotRef, manifest: fmt.Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> torch.Tensor:
        return read_data(self._local(ref).path, manifest, threads,
                               allow_foreign_owner=allow_foreign_owner)

    def has_step(self, step: int) -> bool:
        return any(s.step == step for s in list_snapshots(self.local_dir))

    def read_ahead(self, ref: SnapshotRef, allow_foreign_owner: bool | None = None
                   ) -> FileReadAhead | None:
        return read_ahead(self._local(ref).path, allow_foreign_owner)

    def open_data(self, ref: SnapshotRef, manifest: fmt.Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None,
                  ahead: FileReadAhead | None = None) -> DataFile:
        return DataFile(self._local(ref).path, manifest, threads,
                              allow_foreign_owner=allow_foreign_owner, ahead=ahead)


__all__ = [
    "PosixStorage", "DataFile", "StoredSnapshot", "check_directory", "clean_partial",
    "list_snapshots", "load_manifest", "prune", "read_ahead", "read_data", "write_slot",
]
