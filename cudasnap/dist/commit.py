"""The on-disk layout of a multi-rank step: ``DIR/step-N/rank-RRRRR/`` and ``DIR/step-N/COMMIT``.

The COMMIT marker is JSON (step, world_size, present/missing ranks, replica
groups, job, dead set, epoch), written to a temporary file, fsync'd and
renamed into place; only then does ``latest`` move. A step directory without
it is a round that did not commit and is never loaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import store
from .._native import native
from ..errors import CorruptSnapshot, SnapshotError

COMMIT = "COMMIT"


def rank_dirname(rank: int) -> str:
    return f"rank-{rank:05d}"


def committed_steps(directory: Path) -> list[store.StoredSnapshot]:
    """Step directories holding a COMMIT marker, newest first."""
    return [s for s in store.list_snapshots(directory) if (s.path / COMMIT).is_file()]


def read_commit(step_dir: Path) -> dict[str, Any]:
    try:
        raw, _ = store._read_regular(step_dir / COMMIT, 1 << 20, "commit marker")
        c = json.loads(raw)
    except (OSError, ValueError, SnapshotError) as e:
        raise CorruptSnapshot(f"{step_dir / COMMIT}: unreadable commit marker: {e}") from e
    if not isinstance(c, dict) or not isinstance(c.get("step"), int) \
            or not isinstance(c.get("world_size"), int):
        raise CorruptSnapshot(f"{step_dir / COMMIT}: malformed commit marker")
    return c


def write_commit(directory: Path, step_dir: Path, commit: dict[str, Any]) -> None:
    """COMMIT durably in ``step_dir``, then ``latest`` of ``directory`` points at it."""
    tmp = step_dir / f".{COMMIT}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(commit).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, step_dir / COMMIT)
    native().fsync_dir(str(step_dir))
    store._replace_latest(directory, step_dir.name)
