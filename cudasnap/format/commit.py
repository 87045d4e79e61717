"""The commit marker (``COMMIT``) and the ``latest`` pointer: their content and checks.

A step becomes visible to restore by ONE last write, after all its data and
manifests are durable:

* a multi-rank step (and every step in an object store) by its ``COMMIT``
  object, a JSON record ``{"step", "world_size", "present", "missing", ...}``;
* a single-rank local step by the rename of its directory (POSIX), after which
  ``latest`` names it (a hint only: restore lists step directories).

This module encodes and checks the records; the storage backends
(``cudasnap.storage``) write them durably (posix: write, fsync, rename, fsync
the directory; fsspec: one object PUT, atomic by the object store).
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptSnapshot
from .paths import COMMIT, LATEST, STEP_RE

MAX_COMMIT_BYTES = 1 << 20
MAX_LATEST_BYTES = 4096

__all__ = ["COMMIT", "LATEST", "encode_commit", "decode_commit", "encode_latest",
           "decode_latest", "MAX_COMMIT_BYTES", "MAX_LATEST_BYTES"]


def encode_commit(record: dict[str, Any]) -> bytes:
    if not isinstance(record.get("step"), int) or not isinstance(record.get("world_size"), int):
        raise ValueError(f"a commit record needs integer step and world_size: {record}")
    return json.dumps(record).encode()


def decode_commit(raw: bytes, where: str) -> dict[str, Any]:
    """A commit record, checked; CorruptSnapshot (naming ``where``) when malformed."""
    try:
        c = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptSnapshot(f"{where}: unreadable commit marker: {e}") from e
    if not isinstance(c, dict) or not isinstance(c.get("step"), int) \
            or not isinstance(c.get("world_size"), int):
        raise CorruptSnapshot(f"{where}: malformed commit marker")
    return c


def encode_latest(step_name: str) -> bytes:
    if not STEP_RE.match(step_name):
        raise ValueError(f"not a step directory name: {step_name!r}")
    return (step_name + "\n").encode()


def decode_latest(raw: bytes) -> str | None:
    """The step directory name ``latest`` holds; None when it holds anything else."""
    name = raw.decode("ascii", errors="replace").strip()
    return name if STEP_RE.match(name) else None
