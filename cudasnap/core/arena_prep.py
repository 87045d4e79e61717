"""Staging-arena set-up off the training thread (issue 11 item 8, issue 15 target 1).

Creating a staging arena reserves and maps its pages (seconds per GB on tmpfs)
and, on the CUDA path, page-locks it with ``cudaHostRegister`` (about as long
again). Done inside ``boundary()`` that stops training for minutes at 80 GB,
and again after every restart. The :class:`ArenaPreparer` runs that work on a
background thread instead:

* at construction, an arena sized from the state known then (optimizer state
  that Adam-like optimizers create at their first step is estimated, see
  :func:`estimate_state_bytes`), or the arena a previous process left (it is
  pre-faulted and registered in the background);
* at a boundary whose copy plan no longer fits (regrowth): the old arena is
  retired (its newest snapshot flushed to disk first, see
  ``ArenaKeeper.retire``) and the new one made, in the background.

Boundaries that arrive while the work runs are skipped and counted
(``stats()["skipped_not_ready"]``) with one log line per set-up; a flush, trigger
or ``close()`` meanwhile makes the arena at once (``ensure(sync=True)``, see
cudasnap.core.early). The window is short (issue 23 item 2, bench/start_window.py):
the job runs at the training thread's priority from construction on, a CPU arena is
handed over once reserved (its pre-fault follows, at nice 10, while snapshots use
it), and an inherited CPU arena whose pages are all reserved is adopted by the first
boundary (only its pre-fault runs in the background). Arenas whose
slots hold at most ``arena_sync_max_bytes`` of snapshot data in all (default
16 MiB) are still made synchronously at the first boundary, as before: short
runs and small models snapshot from step 0 on. (Each slot also has a fixed
~5 MiB of headroom and manifest area, so such an arena costs ~10-20 ms on a
loaded 2-core VM, a few ms on a quiet host.)

Split (issue 24): the policy of when and what to set up is the ``ArenaKeeper``'s
(:mod:`cudasnap.core.arena_keeper`: ``start_at_construction``, ``ensure``, ``shutdown``); this
module holds the background jobs it hands the preparer; :mod:`cudasnap.core.arena_size`
sizes the arena (``estimate_state_bytes``, slot and manifest capacities) and
:mod:`cudasnap.core.arena_preparer` runs the set-up (``ArenaPreparer``, ``Prepared``,
``pin``, ``drop``; importable from here too).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .arena_preparer import ArenaPreparer, Prepared, drop, pin
from .arena_size import estimate_meta_len, estimate_state_bytes, meta_capacity, slot_capacity

__all__ = ["SYNC_MAX_BYTES", "ArenaPreparer", "Prepared", "drop", "estimate_meta_len",
           "estimate_state_bytes", "fully_reserved", "meta_capacity", "pin", "prefault_then",
           "slot_capacity", "warm_job"]

if TYPE_CHECKING:
    from cudasnap._C import Arena, CancelFlag

SYNC_MAX_BYTES = 16 << 20


def fully_reserved(arena: Arena) -> bool:
    """Every page of ``arena``'s file is allocated (a set-up that crashed half-way
    leaves holes: a copy into one could SIGBUS when /dev/shm is full)."""
    try:
        st = os.stat(arena.path)
    except OSError:
        return False
    return st.st_blocks * 512 >= arena.total_bytes


def prefault_then(arena: Arena | None, cancel: CancelFlag) -> None:
    """Follow-up of a CPU arena already in use: maps its pages (content untouched)."""
    if arena is not None:
        arena.prefault(cancel)


def warm_job(arena: Arena, device: int | None
             ) -> Callable[[CancelFlag], tuple[Arena, str | None, bool]]:
    """The preparer's job for an inherited arena: pre-fault it, then page-lock it."""
    def job(cancel: CancelFlag) -> tuple[Arena, str | None, bool]:
        arena.prefault(cancel)
        got, reason = pin(arena, device)
        return got, reason, False
    return job
