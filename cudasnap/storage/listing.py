"""What a snapshot directory holds: committed step directories, COMMIT markers, the flush log.

Owns ``StoredSnapshot`` and ``list_snapshots`` (step directories, newest first, no
validation), the multi-rank COMMIT marker (``write_commit``, ``read_commit``,
``is_committed``, ``committed_steps``), the flush log (``append_flush_log``,
``read_flush_log``: one JSON line per flush) and ``prune`` (keep the newest ``keep`` and the
one ``latest`` names).

Call order: ``posix.write_slot`` calls ``prune`` then ``append_flush_log`` after a step is
committed and ``latest`` moved (the fsspec backend appends to its local log likewise);
``cudasnap.distributed.flush_round`` calls ``write_commit`` once every rank's files are in place, and
restore, the vote of ``cudasnap.distributed.restore_vote``, the supervisor and the command line read
with ``list_snapshots`` / ``committed_steps`` / ``read_commit``. Re-exported by
``cudasnap.storage.posix``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._native import native
from ..errors import CorruptSnapshot, SnapshotError
from ..format import manifest as fmt
from ..format.commit import MAX_COMMIT_BYTES, decode_commit, encode_commit
from ..format.paths import COMMIT, DIST_LOG, FLUSH_LOG, MANIFEST, STEP_RE
from .latest import read_latest
from .safe_io import _read_regular, _write_file_durable

log = logging.getLogger("cudasnap.storage.posix")  # one logger for the POSIX backend


@dataclass
class StoredSnapshot:
    """A committed snapshot directory found on disk."""

    step: int
    path: Path

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST


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
    return _read_log(Path(directory) / FLUSH_LOG, "flush log")


def _read_log(path: Path, what: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines log (the flush log, the coordinators' event log)."""
    try:  # (not a FIFO, not a symlink; a damaged line is skipped, not a crash)
        raw, _ = _read_regular(path, fmt.MAX_MANIFEST_BYTES, what)
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


def progress_evidence(directory: Path, steps: list[Any]) -> str | None:
    """What says a job in ``directory`` made progress (its flush log, step directories
    ``steps`` listed by the storage, committed or not, its ``latest`` pointer), or None:
    a restore that finds nothing loadable then must not start over silently (issue 35)."""
    out = []
    flushed = [r["step"] for r in read_flush_log(directory)
               if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)]
    if flushed:
        out.append(f"{FLUSH_LOG} records {len(flushed)} flush(es), the newest of step "
                   f"{max(flushed)}")
    if steps:
        names = sorted((int(s.step) for s in steps), reverse=True)
        out.append("step directories of step(s) " + ", ".join(map(str, names[:4]))
                   + (", ..." if len(names) > 4 else "") + " (none loadable on every rank)")
    latest = read_latest(directory) if Path(directory).is_dir() else None
    if latest:
        out.append(f"'latest' names {latest}")
    earlier = _earlier_attempts(directory)
    if earlier:
        out.append(earlier)
    return "; ".join(out) or None


def _earlier_attempts(directory: Path) -> str | None:
    """The steps the coordinators' event log says ranks reached (its ``progress`` events,
    written from a rank's first boundary on: never by a job still restoring), or None."""
    epochs: set[int] = set()
    reached = -1
    for rec in _read_log(Path(directory) / DIST_LOG, "coordinators' event log"):
        if rec.get("event") == "progress" \
                and isinstance(rec.get("step"), int) and isinstance(rec.get("epoch"), int):
            epochs.add(rec["epoch"])
            reached = max(reached, rec["step"])
    if not epochs:
        return None
    return (f"{DIST_LOG} records ranks that trained to step {reached} at least (attempt(s) "
            f"{', '.join(map(str, sorted(epochs)[-4:]))})")


def prune(directory: Path, keep: int) -> None:
    """Keeps the newest ``keep`` committed snapshots and the one ``latest`` names."""
    if keep <= 0:
        return
    latest = read_latest(directory)
    for s in list_snapshots(directory)[keep:]:
        if s.path.name != latest:
            shutil.rmtree(s.path, ignore_errors=True)
