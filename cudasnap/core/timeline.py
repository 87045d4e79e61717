"""The Timeline: the step rule of ``Snapshotter.boundary()`` and the resume message.

(The fresh start's move is ``cudasnap.storage.fresh``; the final flush ``Flusher.final_flush``.)

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

import operator
from typing import SupportsIndex, cast

from ..errors import ConfigError


def check_step(step: object, last: int | None, restored: int | None) -> int:
    """Returns ``step`` as an int, or raises ConfigError naming the rule it breaks.

    ``last`` is the previous boundary's step, ``restored`` the step a restore put
    back after that boundary (None when neither happened).
    """
    if isinstance(step, bool):
        raise ConfigError(f"boundary({step!r}): the step must be an int, got a bool")
    try:
        value = operator.index(cast(SupportsIndex, step))  # TypeError: not an integer
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

    def advance(self, step: object) -> int:
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
