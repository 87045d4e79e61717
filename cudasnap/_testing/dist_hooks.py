"""TEST-ONLY fault hook of the distributed flush round.

``CUDASNAP_TEST_DIE_IN_FLUSH=RANK[:MIN_STEP]``: that rank SIGKILLs itself right
after writing its files in a flush round of a step >= MIN_STEP, before it
reports them done. Unset (always, outside the tests), the hook does nothing.
"""
from __future__ import annotations

import logging
import os
import signal

from .. import _points

log = logging.getLogger("cudasnap.testing")
ENV_DIE_IN_FLUSH = "CUDASNAP_TEST_DIE_IN_FLUSH"


class DieInFlush:
    def __init__(self, rank: int) -> None:
        rank_s, _, min_step = os.environ.get(ENV_DIE_IN_FLUSH, "").partition(":")
        self.rank = rank
        self.min_step = int(min_step or 0) if rank_s == str(rank) else None

    def after_write(self, step: int) -> None:
        if self.min_step is not None and step >= self.min_step:
            log.error("%s: rank %d dies inside the flush of step %d", ENV_DIE_IN_FLUSH, self.rank,
                      step)
            os.kill(os.getpid(), signal.SIGKILL)


_hooks: dict[int, DieInFlush] = {}


def _at_point(point: str, info: dict[str, object]) -> None:  # cudasnap._points hook
    if point == "dist.flush_written":
        rank, step = int(info["rank"]), int(info["step"])  # type: ignore[call-overload]
        (_hooks.get(rank) or _hooks.setdefault(rank, DieInFlush(rank))).after_write(step)


_points.install("die_in_flush", _at_point)
