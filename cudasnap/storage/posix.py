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
manifest/rename/replace/renamed/latest here.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from ..config import Settings
from ..errors import ConfigError, CorruptSnapshot, FlushError, SnapshotError
from ..format import manifest as fmt
from ..format.commit import (
    MAX_COMMIT_BYTES,
    MAX_LATEST_BYTES,
    decode_commit,
    decode_latest,
    encode_commit,
    encode_latest,
)
from ..format.paths import (
    COMMIT,
    DATA,
    FLUSH_LOG,
    LATEST,
    MANIFEST,
    STEP_RE,
    parse_step_dirname,
    step_dirname,
)
from .partial import clean_partial  # noqa: F401  (re-exported: posix.clean_partial)
from .types import FlushResult

if TYPE_CHECKING:  # type-only: importing this module loads neither torch nor _C
    import torch

    from cudasnap._C import Arena, SlotInfo

log = logging.getLogger("cudasnap.storage.posix")


FOREIGN_ENV = "CUDASNAP_ALLOW_FOREIGN_OWNER"


def _allow_foreign(allow: bool | None) -> bool:
    if allow is not None:
        return bool(allow)
    return Settings.from_env().allow_foreign_owner


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


@dataclass
class StoredSnapshot:
    """A committed snapshot directory found on disk."""

    step: int
    path: Path

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST


def check_directory(directory: Path) -> Path:
    """Creates ``directory`` (0700) if needed and proves it is writable now."""
    directory = Path(directory)
    try:
        # Parents too are created 0700 (Path.mkdir gives them 0777 & ~umask: 0777 under umask 0).
        missing = []
        p = directory
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        for p in reversed(missing):
            p.mkdir(mode=0o700, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"ok")
        os.fsync(fd)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"snapshot directory {directory} is not writable: {e}") from e
    return directory


class DirectoryLock:
    """Exclusive lock of a snapshot directory: one job per directory.

    The lock file holds the owner's pid and host. flock() is released by the
    kernel when the owner dies, so a stale lock is taken over (with a warning
    naming the dead owner) without any pid guessing.
    """

    def __init__(self, directory: Path, rank: int = 0) -> None:
        self.path = Path(directory) / (".lock" if rank == 0 else f".lock-rank{rank}")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(
                f"snapshot directory {self.path.parent} is in use by another job ({owner}); "
                "use another directory or stop that job") from None
        previous = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if previous:
            log.warning("taking over stale lock %s left by %s", self.path, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


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


LATEST_LOCK = ".latest-lock"


def replace_latest(directory: Path, name: str) -> bool:
    """Points ``latest`` at step directory ``name`` atomically (write, fsync, rename, fsync).

    ``latest`` never moves back: when it names a step directory that still exists
    with a higher step, it is left alone (False). Two writers can finish out of
    order: ``cudasnap run``'s flush of the dead attempt's step N ends after the
    restarted attempt flushed N+3. The read-compare-replace runs under an flock of
    ``DIR/.latest-lock``, so neither writer can slip in between.
    """
    new_step = parse_step_dirname(name)
    fd = os.open(directory / LATEST_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cur = read_latest(directory)
        cur_step = parse_step_dirname(cur) if cur else None
        if (cur_step is not None and new_step is not None and cur_step > new_step
                and (directory / step_dirname(cur_step)).is_dir()):
            log.info("latest stays at %s (newer than %s, which was flushed after it)", cur, name)
            return False
        tmp = directory / f".{LATEST}.tmp-{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            _write_file_durable(tmp, encode_latest(name))
            kill_point("latest")
            os.replace(tmp, directory / LATEST)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        native().fsync_dir(str(directory))
        return True
    finally:
        os.close(fd)  # releases the flock


def list_snapshots(directory: Path) -> list[StoredSnapshot]:
    """Committed snapshot directories, newest first (no validation)."""
    out: list[StoredSnapshot] = []
    d = Path(directory)
    if not d.is_dir():
        return out
    for p in d.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out.append(StoredSnapshot(int(m.group(1)), p))
    out.sort(key=lambda s: s.step, reverse=True)
    return out


def read_latest(directory: Path) -> str | None:
    try:
        raw, _ = _read_regular(Path(directory) / LATEST, MAX_LATEST_BYTES, "latest pointer")
    except SnapshotError:
        return None
    return decode_latest(raw)


def write_commit(step_dir: Path, record: dict[str, Any]) -> None:
    """Writes ``step_dir/COMMIT`` durably (write, fsync, rename, fsync the directory)."""
    tmp = step_dir / f".{COMMIT}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        _write_file_durable(tmp, encode_commit(record))
        os.replace(tmp, step_dir / COMMIT)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    native().fsync_dir(str(step_dir))


def read_commit(step_dir: Path) -> dict[str, Any]:
    """The checked COMMIT record of ``step_dir``; CorruptSnapshot when absent or damaged."""
    where = str(Path(step_dir) / COMMIT)
    try:
        raw, _ = _read_regular(Path(step_dir) / COMMIT, MAX_COMMIT_BYTES, "commit marker")
    except (OSError, SnapshotError) as e:
        raise CorruptSnapshot(f"{where}: unreadable commit marker: {e}") from e
    return decode_commit(raw, where)


def is_committed(step_dir: Path) -> bool:
    return (Path(step_dir) / COMMIT).is_file()


def committed_steps(directory: Path) -> list[StoredSnapshot]:
    """Step directories holding a COMMIT marker, newest first."""
    return [s for s in list_snapshots(directory) if is_committed(s.path)]


def complete_slot(arena: Arena, slot: int) -> tuple[SlotInfo, dict[str, Any]]:
    """A leased slot's info and parsed manifest, for a writer: CorruptSnapshot when the slot
    is not COMPLETE or its CRC-consistent manifest is not a JSON object (refuse, never crash)."""
    info = arena.slot_info(slot)
    if not info["valid"]:
        raise CorruptSnapshot(f"slot {slot} of {arena.path} is not complete: {info['problem']}")
    return info, fmt.parse_slot_meta(arena.read_meta(slot), f"slot {slot} of {arena.path}")


def write_slot(arena: Arena, slot: int, directory: Path, *, threads: int = 4,
               io_bytes: int = 16 << 20, keep: int = 3, extra_manifest: dict[str, Any] | None = None,
               subdir: str | None = None, update_latest: bool = True) -> tuple[Path, FlushResult]:
    """Flushes a leased COMPLETE arena slot to ``directory``; returns (path, stats)."""
    C = native()
    t0 = time.perf_counter()
    info, meta = complete_slot(arena, slot)
    step = int(info["step"])
    directory = Path(directory)
    final = directory / step_dirname(step)
    target = final / subdir if subdir else final
    stale: Path | None = None
    if (target / MANIFEST).exists():
        try:
            prev = json.loads(_read_regular(target / MANIFEST, fmt.MAX_MANIFEST_BYTES,
                                            "manifest")[0])
            same = prev.get("slot_seq") == int(info["seq"]) and prev.get("job") == meta.get("job")
        except (SnapshotError, ValueError, RecursionError, AttributeError):
            same = False
        if same:
            log.info("step %d already on disk at %s", step, target)
            return target, {"bytes": 0, "seconds": 0.0, "skipped": True, "step": step}
        # Another run's (or a corrupt) copy of this step: replace it; it is moved
        # aside only once the new copy is complete, then removed.
        stale = target.with_name(f"{target.name}.old-{os.getpid()}")
    if subdir:
        # Ranks share the step directory: each writes DIR/step-N/<subdir>.tmp-<pid>
        # and renames it into place; the COMMIT marker (cudasnap.dist.flush_round)
        # makes the step visible, never the directory itself.
        tmp = final / f"{subdir}.tmp-{os.getpid()}"
        tmp_target = tmp
    else:
        tmp = directory / f"{step_dirname(step)}.tmp-{os.getpid()}"
        tmp_target = tmp
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if subdir:
            final.mkdir(mode=0o700, exist_ok=True)
        tmp_target.mkdir(mode=0o700)
        st = C.write_slot_file(arena, slot, str(tmp_target / DATA), threads, io_bytes, True)
        body = fmt.stored_manifest(meta, info, arena.chunk_bytes, st["crc32c"], extra_manifest)
        _write_file_durable(tmp_target / MANIFEST, body)
        kill_point("manifest")
        C.fsync_dir(str(tmp_target))
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
            replace_latest(directory, final.name)
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


def append_flush_log(directory: Path, rec: dict[str, Any]) -> None:
    """One JSON line per flush (step, bytes, seconds, pid): for operators and the demo."""
    try:
        fd = os.open(Path(directory) / FLUSH_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("could not append to the flush log in %s: %s", directory, e)


def read_flush_log(directory: Path) -> list[dict[str, Any]]:
    try:  # (not a FIFO, not a symlink; a damaged line is skipped, not a crash)
        raw, _ = _read_regular(Path(directory) / FLUSH_LOG, fmt.MAX_MANIFEST_BYTES, "flush log")
    except SnapshotError:
        return []
    out = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def prune(directory: Path, keep: int) -> None:
    """Keeps the newest ``keep`` committed snapshots and the one ``latest`` names."""
    if keep <= 0:
        return
    latest = read_latest(directory)
    for s in list_snapshots(directory)[keep:]:
        if s.path.name != latest:
            shutil.rmtree(s.path, ignore_errors=True)


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
    try:
        st = os.lstat(path)
    except FileNotFoundError:  # torn (e.g. a prune killed half-way): skip it, don't fail restore
        raise CorruptSnapshot(f"{path} is missing (the snapshot is incomplete)") from None
    except OSError as e:
        raise CorruptSnapshot(f"cannot stat {path}: {e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise CorruptSnapshot(f"{path} is not a regular file")
    _check_trust(path, st, allow_foreign_owner)
    if st.st_size != nbytes:
        raise CorruptSnapshot(f"{path} is {st.st_size} bytes, the manifest says {nbytes} "
                              "(truncated or replaced)")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    native().read_file_verified(str(path), buf.data_ptr(), nbytes, int(data["chunk_bytes"]),
                                [int(c) for c in data["crc32c"]], threads)
    return buf


__all__ = [
    "StoredSnapshot", "DirectoryLock", "check_directory", "clean_partial", "list_snapshots",
    "read_latest", "replace_latest", "write_commit", "read_commit", "committed_steps",
    "write_slot", "prune", "load_manifest", "read_data", "read_flush_log", "append_flush_log",
    "MANIFEST", "DATA", "LATEST", "FLUSH_LOG", "COMMIT", "step_dirname",
]
