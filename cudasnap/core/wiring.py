"""How the Snapshotter's components are made and wired (docs/design.md §2.1).

Order: the ones that use no other first (``Counters``, ``Timeline``, ``Backend``),
then ``Layouts`` (the backend), the ``ArenaKeeper`` (the backend; the copier's wait
and the facade's flush as callables), the ``Copier`` (layouts, keeper) and its fence
hooks, the ``Flusher`` and the ``Restorer`` (keeper, copier, ...), the ``EarlySaver``;
last the keeper takes the arena a previous process left, moves the old snapshots aside
(``fresh``) and starts a large arena's set-up. Each component receives the components
and callables it uses, never the Snapshotter. Once the facade made the triggers (the
coordinator and the guard, which take the facade), :func:`attach_triggers`.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from . import arena_prep, fences
from .backend import Backend
from .cadence import Cadence, clock_for
from .counters import Counters
from .early import EarlySaver
from .flush import Flusher
from .layout import Layouts
from .restore import Restorer
from .staging import ArenaKeeper
from .state import TrainingState
from .submit import Copier
from .timeline import Timeline


class Components(NamedTuple):
    counters: Counters
    timeline: Timeline
    backend: Backend
    layouts: Layouts
    keeper: ArenaKeeper
    copier: Copier
    flusher: Flusher
    restorer: Restorer
    early: EarlySaver
    hooks: list[Any]  # the fence hooks' handles (close() removes them)


def wire(state: TrainingState, storage: Any, *, backend: str, supervised: bool,
         sync_max_bytes: int | None, arena_path: Path, num_slots: int, spare_slot: bool,
         chunk_bytes: int | None, job: str, rank: int, world_size: int, keep: int,
         copy_threads: int, flush_threads: int, wait_timeout_s: float,
         snapshot_every: int | None, overhead_budget: float | None,
         device_staging: int | str,
         allow_foreign_owner: bool | None, fresh: bool, wait_copy: Callable[[float], bool],
         flush: Callable[[], Any], require_resume: bool = False) -> Components:
    c = Counters()
    tl = Timeline()
    be = Backend(backend, copy_threads, wait_timeout_s, arena_path, device_staging)
    # Re-entrant: a signal handler may flush while the main thread is in boundary().
    flush_lock = threading.RLock()
    prep = arena_prep.ArenaPreparer(
        arena_prep.SYNC_MAX_BYTES if sync_max_bytes is None else sync_max_bytes,
        be.state_device(state))
    keeper = ArenaKeeper(be, c, prep, arena_path=arena_path, num_slots=num_slots,
                         spare_slot=spare_slot, chunk_bytes=chunk_bytes, job=job,
                         storage=storage, flush_threads=flush_threads,
                         wait_timeout_s=wait_timeout_s, supervised=supervised,
                         flush_lock=flush_lock, wait_copy=wait_copy, flush=flush)
    # a plan's chunk: chunk_bytes, else the keeper's pick (its arena's when that one fits)
    lays = Layouts(state, be, c, chunk=keeper.chunk, rank=rank, world_size=world_size, job=job)
    cp = Copier(state, be, lays, keeper, c, wait_timeout_s=wait_timeout_s,
                cadence=Cadence(snapshot_every, overhead_budget, clock_for(be)))
    hooks = fences.install(state, cp, lays.invalidate)
    flusher = Flusher(storage, keeper, cp, c, flush_lock, keep=keep,
                      flush_threads=flush_threads)
    restorer = Restorer(state, storage, keeper, cp, lays, tl, c, rank=rank,
                        flush_threads=flush_threads, wait_timeout_s=wait_timeout_s,
                        allow_foreign_owner=allow_foreign_owner,
                        require_resume=require_resume and not fresh)
    early = EarlySaver(keeper, cp, lays, tl, c, flush_lock, wait_timeout_s=wait_timeout_s)
    keeper.open_inherited()
    if fresh:
        keeper.start_fresh(world_size, rank)
    # As early as the state is known (issue 23 item 2): the set-up overlaps the rest of
    # the construction and whatever the program does before its first boundary.
    keeper.start_at_construction(state)  # large arenas: off the training thread
    return Components(c, tl, be, lays, keeper, cp, flusher, restorer, early, hooks)


def attach_triggers(parts: Components, dist: Any, guard: Any) -> None:
    """The distributed coordinator (or None) and the guard (or None), once made, handed to
    the components before any trigger can flush; then the guard starts, and last a large
    state's first layout build thread (parked)."""
    parts.flusher.attach(dist, guard)
    if dist is not None:
        parts.copier.cadence.coordinated()  # every rank copies the same boundaries
    parts.restorer.attach(dist, guard)
    parts.keeper.attach(coordinated=dist is not None)
    if guard is not None:
        guard.start()
    parts.layouts.prestart()
