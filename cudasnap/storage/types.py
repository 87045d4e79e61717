"""The records the storage backends return (typed, shared by posix and fsspec).

A leaf module (it imports nothing of cudasnap), so both backends and their
callers can name these types without an import cycle.
"""
from __future__ import annotations

from typing import NotRequired, TypedDict


class FlushResult(TypedDict):
    """What ``write_slot`` returns next to the snapshot's location.

    ``step`` is always there, also when the step was already stored
    (``skipped``: nothing was written, ``bytes`` is 0).
    """

    step: int
    bytes: int
    seconds: float  # the whole call, verify + write + commit
    write_seconds: NotRequired[float]  # the data bytes alone
    fsync_seconds: NotRequired[float]
    skipped: NotRequired[bool]


__all__ = ["FlushResult"]
