"""Object-store snapshot storage through fsspec (``s3://bucket/prefix`` and any fsspec URL).

Layout under the URL ``ROOT`` (the same names as on disk, ``cudasnap.format.paths``)::

    ROOT/step-00000041/data.bin        uploaded first
    ROOT/step-00000041/manifest.json   then the manifest (its own CRC32C, the chunk CRCs)
    ROOT/step-00000041/COMMIT          last: the step is visible only once this object exists
    ROOT/latest                        hint: name of the newest committed step

Atomicity. An object store has no rename, so the marker protocol of
multi-rank POSIX steps is used for every step: data objects first, then the
manifest, then the ``COMMIT`` object (one PUT: it exists whole or not at all).
A flush killed at any moment leaves a step without ``COMMIT``: restore never
lists it (``list_snapshots`` returns committed steps only) and the next writer
removes it (``clean_partial``). Every read is verified as on disk: the manifest
is size-limited, CRC-checked and validated before a data byte is read, the data
object's size must match, and every chunk is CRC32C-checked after download;
a damaged step is skipped with a warning naming the object.

Re-flushing a step already committed with other content first deletes its
``COMMIT`` (the step becomes invisible), then uploads, then commits again.

One job per URL. Objects stores have no flock: the directory lock of a URL is a
local lock file (``DirectoryLock`` in ``state_dir(url)``, keyed by the URL's
hash), which excludes writers on this host only. Two jobs on two hosts flushing
to the same URL at once are NOT detected: run one job per URL (the same
assumption as DCP's fsspec writer). The ranks of one multi-rank job share the
URL: each uploads ``step-N/rank-R/``, one commits (``storage.remote_ranks``).
``latest`` moves by compare-and-swap where the store has conditional writes
(``storage.remote_latest``). A writer marks its part while it uploads, so that
``clean_partial`` leaves a live writer's step alone (``remote_ranks``).

Buckets are never created: a URL whose bucket (``s3://BUCKET/...``, also gs, az) does
not exist is refused with a ConfigError naming it (a typo must not create a bucket in
the user's account); the prefix below it needs no creation (objects stores have no
directories). An unreachable store is a SnapshotError with one line naming the URL
and the cause (``cudasnap inspect/verify URL``: that line, exit 2).

Options: ``CUDASNAP_S3_ENDPOINT`` (e.g. ``http://127.0.0.1:9000``) sets the S3
endpoint; credentials come from the usual AWS variables or files (botocore).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from ..config import Settings
from ..errors import ConfigError, CorruptSnapshot, FlushError, IncompatibleSnapshot, SnapshotError
from ..format import manifest as fmt
from ..format.commit import MAX_COMMIT_BYTES, decode_commit, decode_latest, encode_commit
from ..format.paths import COMMIT, DATA, ID_FILE, LATEST, MANIFEST, parse_step_dirname, step_dirname
from . import counters, remote_latest, remote_ranks
from .listing import StoredSnapshot, append_flush_log
from .remote_base import (
    _BUCKETED,
    UPLOAD_BLOCK,
    RemoteSnapshot,
    _one_line,
    _Unreachable,
    filesystem,
    state_dir,
)
from .slots import complete_slot
from .types import FlushResult

if TYPE_CHECKING:  # type-only: importing this module loads neither torch nor _C
    import torch
    from fsspec import AbstractFileSystem

    from cudasnap._C import Arena

log = logging.getLogger("cudasnap.storage.fsspec")


#: a snapshot a storage lists: on local disk or in an object store
SnapshotRef = StoredSnapshot | RemoteSnapshot


class FsspecStorage(remote_ranks.RankParts):
    """``storage.protocol.Storage`` of one fsspec URL (see the module docstring).
    ``settings``: the entry point's (the state directory, the S3 endpoint, the world size);
    ``fs``: the (filesystem, root) to use instead of the URL's own (``object_dir``)."""

    def __init__(self, url: str, settings: Settings,
                 fs: tuple[AbstractFileSystem, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.settings = settings
        self.fs, self.root = fs or filesystem(self.url, settings.s3_endpoint)
        self.protocol = self.url.split("://", 1)[0]
        self.local_dir = state_dir(self.url, settings.state_dir)

    @classmethod
    def open(cls, url: str, settings: Settings) -> FsspecStorage:
        """The storage of ``url``, checked (bucket, writable prefix, directory id)."""
        st = cls(url, settings)
        st.check()
        st.share_id()
        return st

    # ------------------------------------------------------------ names
    def _key(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _url(self, key: str) -> str:
        return f"{self.protocol}://{key}"

    def where(self, ref: RemoteSnapshot) -> str:
        return ref.path

    def _remote_key(self, ref: SnapshotRef) -> str:
        """The object key of a snapshot of this store (ConfigError for any other)."""
        prefix = f"{self.protocol}://"
        if not isinstance(ref, RemoteSnapshot) or not ref.path.startswith(prefix):
            raise ConfigError(f"{ref.path} is not a snapshot of {self.url}")
        return ref.path[len(prefix):]

    def _keys(self, ref: SnapshotRef) -> tuple[str, str]:
        """(step key, part key) of ``ref``: a step of this store (part = step), one rank's
        part of it (``.../step-N/rank-R``), or the local index's path of either."""
        if isinstance(ref, StoredSnapshot) and self._indexed(ref.path):
            rel = Path(os.path.abspath(ref.path)).relative_to(os.path.abspath(self.local_dir))
            k = self._key(*rel.parts)
        else:
            k = self._remote_key(ref)
        head, _, last = k.rpartition("/")
        if remote_ranks.RANK_RE.match(last) and \
                parse_step_dirname(head.rsplit("/", 1)[-1]) is not None:
            return head, k
        return k, k

    def _indexed(self, path: Path) -> bool:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.local_dir))
        parts = Path(rel).parts
        return 1 <= len(parts) <= 2 and parse_step_dirname(parts[0]) is not None and \
            (len(parts) == 1 or remote_ranks.RANK_RE.match(parts[1]) is not None)

    def _resolve(self, ref: SnapshotRef) -> tuple[int, str, dict[str, Any]]:
        """(step, key of the part holding manifest and data, COMMIT record) of ``ref``.

        A whole multi-rank step opened by one process loads only replicated state (its
        first present rank's part), as on disk; sharded state is IncompatibleSnapshot."""
        step_key, part = self._keys(ref)
        url = self._url(step_key)
        step = parse_step_dirname(step_key.rsplit("/", 1)[-1])
        c = decode_commit(self._cat(f"{step_key}/{COMMIT}", MAX_COMMIT_BYTES, "commit marker"),
                          f"{url}/{COMMIT}")
        if step is None or c["step"] != step or ref.step not in (-1, step):
            raise CorruptSnapshot(f"{url}/{COMMIT} names step {c['step']}, not "
                                  f"{step if ref.step == -1 else ref.step}")
        if part == step_key and c["world_size"] > 1:
            groups = c.get("replica_groups") or []
            if not isinstance(groups, list) or len(groups) != 1:
                raise IncompatibleSnapshot(
                    f"{url} holds sharded state of {c['world_size']} ranks; restore it with "
                    f"torch.distributed and {c['world_size']} ranks")
            have = remote_ranks.present_ranks(self, step, int(c["world_size"]))
            if not have:
                raise CorruptSnapshot(f"{url}: no rank's part is present")
            part = remote_ranks.rank_key(self, step, have[0])
        return step, part, c

    def bucket(self) -> str | None:
        """The bucket (container) of a bucketed store's URL, else None."""
        if self.protocol.lower() in _BUCKETED:
            return self.root.split("/", 1)[0] or None
        return None

    def check(self) -> None:
        """Proves the URL writable now; never creates a bucket (see the module docstring)."""
        bucket = self.bucket()
        if bucket is not None:
            try:
                self.fs.info(bucket)
            except FileNotFoundError:
                raise ConfigError(f"snapshot URL {self.url}: bucket {bucket!r} does not exist; "
                                  "cudasnap never creates buckets: create it, or fix the "
                                  "name") from None
            except Exception as e:  # noqa: BLE001 - botocore errors are not OSError
                raise ConfigError(f"snapshot URL {self.url} is not reachable: "
                                  f"{_one_line(e)}") from e
        probe = self._key(f".probe-{os.getpid()}")
        try:
            if bucket is None and not self.fs.exists(self.root):
                self.fs.makedirs(self.root, exist_ok=True)  # a file system's directory
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - any backend error means: not usable
            raise ConfigError(f"snapshot URL {self.url} is not writable: {_one_line(e)}") from e

    def share_id(self) -> str:
        """The URL's directory id, the same on every host (``remote_latest.share_id``)."""
        with _Unreachable(self.url, "read the directory id of"):
            return remote_latest.share_id(self.fs, self.protocol, self._key(ID_FILE),
                                          self.local_dir)

    # ------------------------------------------------------------ listing
    def _step_dirs(self) -> dict[int, str]:
        # Another process may have written since; the whole cache, not just ROOT's listing:
        # a cached listing of a step (from an earlier find or ls) would hide its new COMMIT.
        self.fs.invalidate_cache()
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return {}
        out = {}
        for n in names:
            step = parse_step_dirname(str(n).rstrip("/").rsplit("/", 1)[-1])
            if step is not None:
                out[step] = str(n).rstrip("/")
        return out

    def list_snapshots(self) -> list[RemoteSnapshot]:
        """Committed snapshots (their COMMIT object exists), newest first; no validation."""
        out = [RemoteSnapshot(s, self._url(k)) for s, k in self._step_dirs().items()
               if self.fs.exists(f"{k}/{COMMIT}")]
        out.sort(key=lambda s: s.step, reverse=True)
        return out

    def progress_evidence(self) -> str | None:
        """The flush log of this host's state directory, the step prefixes in the store."""
        from . import listing

        return listing.progress_evidence(self.local_dir, self.list_snapshots())

    def clean_partial(self) -> list[str]:
        """Removes steps without COMMIT (killed flushes), except those of a writer still at
        work (``remote_ranks.writer_in_progress``); then rebuilds the local index."""
        removed = []
        for _, k in sorted(self._step_dirs().items()):
            if self.fs.exists(f"{k}/{COMMIT}"):
                continue
            busy = remote_ranks.writer_in_progress(self, k)
            if busy is not None:
                log.info("%s is not committed, but its writer may be at work (%s): left alone",
                         self._url(k), self._url(busy))
                continue
            try:
                self.fs.rm(k, recursive=True)
            except FileNotFoundError:
                continue  # another rank of the job removed it first
            removed.append(self._url(k))
        if remote_ranks.index_wanted(self):
            remote_ranks.sync_index(self)
        return removed

    def read_latest(self) -> str | None:
        try:
            return decode_latest(self.fs.cat_file(self._key(LATEST)))
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------ write
    def _committed_same(self, step_key: str, part: str, job: object, seq: int) -> bool:
        """True when ``part`` holds this slot's copy (same seq, same job), committed."""
        try:
            prev = json.loads(self.fs.cat_file(f"{part}/{MANIFEST}"))
            return (self.fs.exists(f"{step_key}/{COMMIT}") and prev.get("slot_seq") == seq
                    and prev.get("job") == job)
        except (OSError, ValueError, RecursionError, AttributeError):
            return False

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """A backend error (botocore/aiohttp errors are not OSError) becomes a FlushError."""
        try:
            yield
        except SnapshotError:
            raise
        except Exception as e:  # noqa: BLE001
            raise FlushError(f"{what} failed: {e}") from e

    def _upload_data(self, key: str, arena: Arena, slot: int, nbytes: int) -> None:
        """``key/data.bin`` from the slot, in UPLOAD_BLOCK parts."""
        with self.fs.open(f"{key}/{DATA}", "wb", block_size=UPLOAD_BLOCK) as f:
            view = arena.data_view(slot, nbytes) if nbytes else memoryview(b"")
            for off in range(0, nbytes, UPLOAD_BLOCK):
                block = view[off:off + UPLOAD_BLOCK]
                f.write(block)  # (a full block is uploaded as one part before it returns;
                counters.add_written(len(block))  # some files' write() returns None)
                kill_point("upload")

    def replace_latest(self, step: int, timeout: float | None = None) -> bool:
        """``latest`` -> step ``step`` unless it names a newer committed step (CAS on S3);
        ``timeout``: no compare-and-swap retried past it."""
        return remote_latest.replace_latest(
            self.fs, self.protocol, self._key(LATEST), step_dirname(step),
            lambda s: bool(self.fs.exists(self._key(step_dirname(s), COMMIT))), timeout)

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None, timeout: float | None = None
                   ) -> tuple[str, FlushResult]:
        """Uploads a leased COMPLETE slot: data, manifest, then COMMIT, then ``latest``
        (``timeout``: bound of its compare-and-swap retries)."""
        C = native()
        t0 = time.perf_counter()
        info, meta = complete_slot(arena, slot)
        step, nbytes, chunk = int(info["step"]), int(info["data_bytes"]), int(arena.chunk_bytes)
        key = self._key(step_dirname(step))
        if self._committed_same(key, key, meta.get("job"), int(info["seq"])):
            log.info("step %d already stored at %s", step, self._url(key))
            return self._url(key), {"bytes": 0, "seconds": 0.0, "skipped": True, "step": step}
        crcs = [int(c) for c in arena.read_table(slot)]
        bad = C.verify_buffer(arena.data_ptr(slot), nbytes, chunk, crcs, threads) if nbytes else -1
        if bad >= 0:  # never upload bytes that do not match their checksums
            raise CorruptSnapshot(f"slot {slot} of {arena.path}: chunk {bad} fails its CRC32C")
        with self._failing(f"flush of step {step} to {self._url(key)}"):
            if self.fs.exists(f"{key}/{COMMIT}"):  # another run's copy: invisible first
                self.fs.rm_file(f"{key}/{COMMIT}")
            marker = remote_ranks.mark_writer(self, key)
            t1 = time.perf_counter()
            self._upload_data(key, arena, slot, nbytes)
            write_s = time.perf_counter() - t1
            self.fs.pipe_file(f"{key}/{MANIFEST}",
                              fmt.stored_manifest(meta, info, chunk, crcs, extra_manifest))
            kill_point("manifest")
            self.fs.pipe_file(f"{key}/{COMMIT}", encode_commit(
                {"step": step, "world_size": 1, "present": [int(meta.get("rank", 0))],
                 "missing": [], "job": meta.get("job"), "time": time.time()}))
            kill_point("commit")
            remote_ranks.unmark_writer(self, marker)
            self.replace_latest(step, timeout)
        self.prune(keep)
        elapsed = time.perf_counter() - t0
        stats: FlushResult = {"bytes": nbytes, "seconds": elapsed, "write_seconds": write_s,
                              "fsync_seconds": 0.0, "step": step}
        log.info("flushed step %d: %.1f MB in %.3f s to %s", step, nbytes / 1e6, elapsed,
                 self._url(key))
        append_flush_log(self.local_dir, {**stats, "pid": os.getpid(), "time": time.time(),
                                                "path": self._url(key)})
        return self._url(key), stats

    def prune(self, keep: int) -> None:
        """Keeps the newest ``keep`` committed steps (COMMIT removed first, then the rest)."""
        if keep <= 0:
            return
        for s in self.list_snapshots()[keep:]:
            k = s.path.split("://", 1)[1]
            try:
                self.fs.rm_file(f"{k}/{COMMIT}")
                self.fs.rm(k, recursive=True)
            except OSError as e:
                log.warning("could not prune %s: %s", s.path, e)

    # ------------------------------------------------------------ read
    def _cat(self, key: str, limit: int, what: str) -> bytes:
        try:
            size = int(self.fs.size(key))
            if size > limit:
                raise CorruptSnapshot(f"{self._url(key)} is {size} bytes, larger than any {what}")
            return bytes(self.fs.cat_file(key))
        except FileNotFoundError:
            raise CorruptSnapshot(f"{self._url(key)} is missing (the snapshot is "
                                  "incomplete)") from None
        except OSError as e:
            raise CorruptSnapshot(f"cannot read {self._url(key)}: {e}") from e

    def load_manifest(self, ref: SnapshotRef, *, allow_foreign_owner: bool | None = None
                      ) -> fmt.Manifest:
        """The step's COMMIT and manifest, checked before any data byte is read.

        (``allow_foreign_owner``: a file-ownership check of local disks; objects have none.)
        """
        step, part, _ = self._resolve(ref)
        where = self._url(f"{part}/{MANIFEST}")
        m = fmt.parse_manifest(self._cat(f"{part}/{MANIFEST}", fmt.MAX_MANIFEST_BYTES,
                                         "manifest"), where)
        if m["step"] != step:
            raise CorruptSnapshot(f"{where} holds step {m['step']}, not {step}")
        rank = remote_ranks.RANK_RE.match(part.rsplit("/", 1)[-1])
        if rank is not None and int(m.get("rank", -1)) != int(rank.group(1)):
            raise CorruptSnapshot(f"{where} is rank {m.get('rank')}'s, not rank "
                                  f"{int(rank.group(1))}'s")
        return m

    def read_data(self, ref: SnapshotRef, manifest: fmt.Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> torch.Tensor:
        """Downloads data.bin into a new uint8 tensor, every chunk CRC32C-verified."""
        import torch

        d = manifest["data"]
        key = f"{self._resolve(ref)[1]}/{DATA}"
        nbytes = int(d["bytes"])
        try:
            size = int(self.fs.size(key))
        except FileNotFoundError:
            raise CorruptSnapshot(f"{self._url(key)} is missing (the snapshot is "
                                  "incomplete)") from None
        if size != nbytes:
            raise CorruptSnapshot(f"{self._url(key)} is {size} bytes, the manifest says {nbytes} "
                                  "(truncated or replaced)")
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = buf.numpy().data
        try:
            with self.fs.open(key, "rb", block_size=UPLOAD_BLOCK) as f:
                off = 0
                while off < nbytes:
                    n = f.readinto(view[off:off + UPLOAD_BLOCK])
                    if not n:
                        raise CorruptSnapshot(f"{self._url(key)} ended at byte {off} of {nbytes}")
                    off += n
                    counters.add_read(n)
        except OSError as e:
            raise CorruptSnapshot(f"cannot read {self._url(key)}: {e}") from e
        bad = native().verify_buffer(buf.data_ptr(), nbytes, int(d["chunk_bytes"]),
                                     [int(c) for c in d["crc32c"]], threads) if nbytes else -1
        if bad >= 0:
            raise CorruptSnapshot(f"{self._url(key)}: chunk {bad} fails its CRC32C")
        return buf

    def has_step(self, step: int) -> bool:
        return any(s.step == step for s in self.list_snapshots())

    def read_ahead(self, ref: SnapshotRef, allow_foreign_owner: bool | None = None) -> None:
        return None  # the download is one read of its own

    def open_data(self, ref: SnapshotRef, manifest: fmt.Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None, ahead: Any = None) -> torch.Tensor:
        return self.read_data(ref, manifest, threads, allow_foreign_owner=allow_foreign_owner)

    def verify(self, ref: RemoteSnapshot, threads: int = 4) -> tuple[bool, str]:
        """(ok, message) for ``cudasnap verify``: manifest checks and every chunk's CRC (of
        every rank's part of a multi-rank step)."""
        from .remote_report import verify_ref

        return verify_ref(self, ref, threads)
