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

Single writer. Objects stores have no flock: the directory lock of a URL is a
local lock file (``DirectoryLock`` in ``state_dir(url)``, keyed by the URL's
hash), which excludes writers on this host only. Two hosts flushing to the same
URL at once are NOT detected: run one job per URL (the same assumption as
DCP's fsspec writer). Multi-rank jobs need a local or shared file system.

Buckets are never created: a URL whose bucket (``s3://BUCKET/...``, also gs, az) does
not exist is refused with a ConfigError naming it (a typo must not create a bucket in
the user's account); the prefix below it needs no creation (objects stores have no
directories). An unreachable store is a SnapshotError with one line naming the URL
and the cause (``cudasnap inspect/verify URL``: that line, exit 2).

Options: ``CUDASNAP_S3_ENDPOINT`` (e.g. ``http://127.0.0.1:9000``) sets the S3
endpoint; credentials come from the usual AWS variables or files (botocore).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from ..config import Settings
from ..errors import ConfigError, CorruptSnapshot, FlushError, SnapshotError
from ..format import manifest as fmt
from ..format.commit import MAX_COMMIT_BYTES, decode_commit, decode_latest, encode_commit, encode_latest
from ..format.paths import COMMIT, DATA, LATEST, MANIFEST, parse_step_dirname, step_dirname, url_hash
from . import counters, posix
from .types import FlushResult

if TYPE_CHECKING:  # type-only: importing this module loads neither torch nor _C
    import torch
    from fsspec import AbstractFileSystem

    from cudasnap._C import Arena

log = logging.getLogger("cudasnap.storage.fsspec")

UPLOAD_BLOCK = 16 << 20

#: protocols whose first path component is a bucket/container, never created here
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def _one_line(e: BaseException) -> str:
    """A backend error as one line: its type and first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class _Unreachable:
    """``with _Unreachable(url, what):`` a backend error (connection refused, DNS, auth)
    becomes a SnapshotError of one line naming the URL; cudasnap errors pass."""

    def __init__(self, url: str, what: str) -> None:
        self.url, self.what = url, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: object) -> None:
        if e is None or isinstance(e, SnapshotError) or not isinstance(e, Exception):
            return
        raise SnapshotError(f"cannot {self.what} {self.url}: {_one_line(e)}") from e


def state_dir(url: str) -> Path:
    """This host's local directory for a URL: lock, directory id (job), flush log."""
    base = Settings.from_env().state_dir or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cudasnap"
    return posix.check_directory(base / f"url-{url_hash(url)}")


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """(fsspec filesystem, root path without protocol) of ``url``."""
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ConfigError(f"{url}: object-store directories need fsspec "
                          "(pip install 'cudasnap[s3]')") from e
    opts: dict[str, Any] = {}
    endpoint = Settings.from_env().s3_endpoint
    if url.startswith(("s3://", "s3a://")) and endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"cannot open snapshot URL {url}: {e}") from e
    return fs, str(root).rstrip("/")


@dataclass
class RemoteSnapshot:
    """A committed snapshot in an object store (``path``: its URL)."""

    step: int
    path: str

    @property
    def manifest_path(self) -> str:
        return f"{self.path}/{MANIFEST}"


#: a snapshot a storage lists: on local disk or in an object store
SnapshotRef = posix.StoredSnapshot | RemoteSnapshot


class FsspecStorage:
    """StorageWriter and StorageReader of one fsspec URL (see the module docstring)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.protocol = self.url.split("://", 1)[0]
        self.local_dir = state_dir(self.url)

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

    # ------------------------------------------------------------ listing
    def _step_dirs(self) -> dict[int, str]:
        self.fs.invalidate_cache(self.root)  # another process may have written since
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

    def clean_partial(self) -> list[str]:
        """Removes steps without COMMIT (killed flushes); single writer assumed."""
        removed = []
        for _, k in sorted(self._step_dirs().items()):
            if not self.fs.exists(f"{k}/{COMMIT}"):
                self.fs.rm(k, recursive=True)
                removed.append(self._url(k))
        return removed

    def read_latest(self) -> str | None:
        try:
            return decode_latest(self.fs.cat_file(self._key(LATEST)))
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------ write
    def _committed_same(self, step_key: str, job: object, seq: int) -> bool:
        try:
            prev = json.loads(self.fs.cat_file(f"{step_key}/{MANIFEST}"))
            return (self.fs.exists(f"{step_key}/{COMMIT}") and prev.get("slot_seq") == seq
                    and prev.get("job") == job)
        except (OSError, ValueError, RecursionError, AttributeError):
            return False

    def write_slot(self, arena: Arena, slot: int, *, threads: int = 4, keep: int = 3,
                   extra_manifest: dict[str, Any] | None = None) -> tuple[str, FlushResult]:
        """Uploads a leased COMPLETE slot: data, manifest, then COMMIT, then ``latest``."""
        C = native()
        t0 = time.perf_counter()
        info, meta = posix.complete_slot(arena, slot)
        step, nbytes, chunk = int(info["step"]), int(info["data_bytes"]), int(arena.chunk_bytes)
        key = self._key(step_dirname(step))
        if self._committed_same(key, meta.get("job"), int(info["seq"])):
            log.info("step %d already stored at %s", step, self._url(key))
            return self._url(key), {"bytes": 0, "seconds": 0.0, "skipped": True, "step": step}
        crcs = [int(c) for c in arena.read_table(slot)]
        bad = C.verify_buffer(arena.data_ptr(slot), nbytes, chunk, crcs, threads) if nbytes else -1
        if bad >= 0:  # never upload bytes that do not match their checksums
            raise CorruptSnapshot(f"slot {slot} of {arena.path}: chunk {bad} fails its CRC32C")
        try:
            if self.fs.exists(f"{key}/{COMMIT}"):  # another run's copy: invisible first
                self.fs.rm_file(f"{key}/{COMMIT}")
            t1 = time.perf_counter()
            with self.fs.open(f"{key}/{DATA}", "wb", block_size=UPLOAD_BLOCK) as f:
                view = arena.data_view(slot, nbytes) if nbytes else memoryview(b"")
                for off in range(0, nbytes, UPLOAD_BLOCK):
                    block = view[off:off + UPLOAD_BLOCK]
                    f.write(block)  # (a full block is uploaded as one part before it returns;
                    counters.add_written(len(block))  # some files' write() returns None)
                    kill_point("upload")
            write_s = time.perf_counter() - t1
            self.fs.pipe_file(f"{key}/{MANIFEST}",
                              fmt.stored_manifest(meta, info, chunk, crcs, extra_manifest))
            kill_point("manifest")
            self.fs.pipe_file(f"{key}/{COMMIT}", encode_commit(
                {"step": step, "world_size": 1, "present": [int(meta.get("rank", 0))],
                 "missing": [], "job": meta.get("job"), "time": time.time()}))
            kill_point("commit")
            self.fs.pipe_file(self._key(LATEST), encode_latest(step_dirname(step)))
        except SnapshotError:
            raise
        except Exception as e:  # noqa: BLE001 - botocore/aiohttp errors are not OSError
            raise FlushError(f"flush of step {step} to {self._url(key)} failed: {e}") from e
        self.prune(keep)
        elapsed = time.perf_counter() - t0
        stats: FlushResult = {"bytes": nbytes, "seconds": elapsed, "write_seconds": write_s,
                              "fsync_seconds": 0.0, "step": step}
        log.info("flushed step %d: %.1f MB in %.3f s to %s", step, nbytes / 1e6, elapsed,
                 self._url(key))
        posix.append_flush_log(self.local_dir, {**stats, "pid": os.getpid(), "time": time.time(),
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
        k = self._remote_key(ref)
        c = decode_commit(self._cat(f"{k}/{COMMIT}", MAX_COMMIT_BYTES, "commit marker"),
                          f"{ref.path}/{COMMIT}")
        if c["step"] != ref.step:
            raise CorruptSnapshot(f"{ref.path}/{COMMIT} names step {c['step']}, not {ref.step}")
        m = fmt.parse_manifest(self._cat(f"{k}/{MANIFEST}", fmt.MAX_MANIFEST_BYTES, "manifest"),
                               f"{ref.path}/{MANIFEST}")
        if m["step"] != ref.step:
            raise CorruptSnapshot(f"{ref.path}/{MANIFEST} holds step {m['step']}, not {ref.step}")
        return m

    def read_data(self, ref: SnapshotRef, manifest: fmt.Manifest, threads: int = 4, *,
                  allow_foreign_owner: bool | None = None) -> torch.Tensor:
        """Downloads data.bin into a new uint8 tensor, every chunk CRC32C-verified."""
        import torch

        d = manifest["data"]
        key = f"{self._remote_key(ref)}/{DATA}"
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

    def verify(self, ref: RemoteSnapshot, threads: int = 4) -> tuple[bool, str]:
        """(ok, message) for ``cudasnap verify``: manifest checks and every chunk's CRC."""
        t0 = time.perf_counter()
        try:
            m = self.load_manifest(ref)
            self.read_data(ref, m, threads)
        except SnapshotError as e:
            return False, str(e)
        n = int(m["data"]["bytes"])
        dt = time.perf_counter() - t0
        return True, (f"{n / 1e6:.1f} MB, {len(m['data']['crc32c'])} chunks, "
                      f"{n / max(dt, 1e-9) / 1e9:.2f} GB/s")


def inspect_rows(url: str, verify: bool = False) -> list[dict[str, Any]]:
    """``cudasnap inspect URL``: one row per committed snapshot (the CLI's row format).

    An unreachable store: one-line SnapshotError (the CLI prints it, exit 2)."""
    with _Unreachable(url, "list"):
        return _inspect_rows(url, verify)


def _inspect_rows(url: str, verify: bool) -> list[dict[str, Any]]:
    st = FsspecStorage(url)
    latest = st.read_latest()
    rows: list[dict[str, Any]] = []
    for s in st.list_snapshots():
        row: dict[str, Any] = {"step": s.step, "source": st.protocol[:6], "path": s.path,
                               "commit": "committed", "latest": s.path.endswith(f"/{latest}")}
        try:
            m = st.load_manifest(s)
            row.update({"bytes": m["data"]["bytes"], "tensors": len(m["tensors"]),
                        "rank": m.get("rank", 0), "world_size": m.get("world_size", 1),
                        "created": m.get("created_unix"), "status": "unverified"})
        except SnapshotError as e:
            row["status"] = f"bad: {e}"
        if verify and not row["status"].startswith("bad"):
            ok, msg = st.verify(s)
            row["status"] = "ok" if ok else f"FAILED: {msg}"
        rows.append(row)
    return rows


def verify_lines(url: str, step: int | None = None) -> tuple[int, list[str]]:
    """``cudasnap verify URL``: (exit code, report lines); 2 when nothing was verified.

    An unreachable store: one-line SnapshotError (the CLI prints it, exit 2)."""
    with _Unreachable(url, "verify"):
        return _verify_lines(url, step)


def _verify_lines(url: str, step: int | None) -> tuple[int, list[str]]:
    st = FsspecStorage(url)
    snaps = [s for s in st.list_snapshots() if step is None or s.step == step]
    if not snaps:
        return 2, [f"no snapshot{'' if step is None else f' of step {step}'} in {url}"]
    lines, bad = [], 0
    for s in snaps:
        ok, msg = st.verify(s)
        bad += not ok
        lines.append(f"step {s.step}: {'ok' if ok else 'FAILED'} ({msg})")
    return (1 if bad else 0), lines
