"""The step rule of ``Snapshotter.boundary()`` and the resume / fresh-start bookkeeping.

Step rule: a step is a non-negative integer (``bool`` and floats are refused;
numpy/torch integer scalars are accepted) and steps strictly increase. The
reference for "increase" is the previous ``boundary()`` step or, after
``restore_latest()`` / ``rollback()``, the restored step, whichever came last:
after a restore the next step may be anything above the restored one. A lower
step is refused (disk snapshots are ordered by step, so a lower step would be
hidden behind the old ones at the next restore); to start over, pass
``fresh=True`` (or ``cudasnap run --fresh``), which moves the old snapshots aside.

The :class:`Timeline` owns the steps. Call order: ``Snapshotter.boundary()`` calls
:meth:`Timeline.advance` first (the rule, or its ConfigError; nothing is recorded
then); the ``Restorer`` calls :meth:`Timeline.restored_at` after a restore or
rollback; the flusher, the early saver and the coordinator's adapter read
``last_step``.
"""
from __future__ import annotations

import logging
import operator
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError, SnapshotError

log = logging.getLogger("cudasnap")

def check_step(step: Any, last: int | None, restored: int | None) -> int:
    """Returns ``step`` as an int, or raises ConfigError naming the rule it breaks.

    ``last`` is the previous boundary's step, ``restored`` the step a restore put
    back after that boundary (None when neither happened).
    """
    if isinstance(step, bool):
        raise ConfigError(f"boundary({step!r}): the step must be an int, got a bool")
    try:
        value = operator.index(step)
    except TypeError:
        raise ConfigError(f"boundary({step!r}): the step must be an int, got "
                          f"{type(step).__name__}") from None
    if value < 0:
        raise ConfigError(f"boundary({value}): the step must not be negative")
    if restored is not None:
        if value <= restored:
            raise ConfigError(
                f"boundary({value}) after the restored step {restored}: steps must increase "
                f"(resume at {restored + 1}); to start over use fresh=True")
    elif last is not None and value <= last:
        raise ConfigError(f"boundary({value}) after boundary step {last}: steps must "
                          "strictly increase; to start over use fresh=True")
    return value


class Timeline:
    def __init__(self) -> None:
        self.last_step: int | None = None  # the newest boundary's step
        self.restored: int | None = None  # the step a restore put back after it
        self.boundaries = 0  # boundary() calls of this process that passed the rule

    def advance(self, step: Any) -> int:
        """The step rule for ``boundary(step)``; records and returns the step as an int.
        (The common case, an int above the last step, costs four comparisons.)"""
        last = self.last_step
        if type(step) is not int or last is None or step <= last or self.restored is not None:
            step = check_step(step, last, self.restored)  # the rule, or its error
        self.restored = None
        self.boundaries += 1
        self.last_step = step
        return step

    def restored_at(self, step: int) -> None:
        """A restore or rollback put ``step`` back: the next boundary must be above it."""
        self.restored = step


def resume_message(step: int, source: str | None, where: str | None) -> str:
    return (f"resuming at step {step + 1} from the snapshot of step {step} in {source} "
            f"({where}); pass fresh=True (cudasnap run --fresh) to start over")


class ClosingSnapshots(Protocol):
    """What ``final_flush`` needs of the Snapshotter (no private fields)."""

    def staged_arenas(self) -> list[Any]: ...
    def flush_if_new(self, wait_s: float = 60.0) -> Path | None: ...


def final_flush(closing: ClosingSnapshots) -> bool:
    """``close()`` with ``flush_on_close``: flushes the newest snapshot unless that step is
    already on disk. False when the flush failed (the caller then keeps the arena)."""
    arenas = closing.staged_arenas()
    if not arenas:
        return True
    try:
        closing.flush_if_new(60.0)
        return True
    except SnapshotError as e:
        log.error("close(): the final flush failed (%s); the arena %s is kept", e,
                  arenas[0].path)
        return False


def arena_slots(arena: Any, num_slots: int, spare: bool) -> dict[str, Any]:
    """stats() fields: the arena's slot count and bytes, and what the spare slot costs."""
    n = arena.num_slots if arena is not None else num_slots
    per_slot = (arena.total_bytes - 4096) // n if arena is not None else None
    return {"arena_slots": n, "arena_bytes": arena.total_bytes if arena is not None else None,
            "spare_slot_bytes": (per_slot if spare else 0) if per_slot is not None else None}
