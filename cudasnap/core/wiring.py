"""How the Snapshotter's components are made and wired (docs/design.md §2.1).

Order: the ones that use no other first (``Counters``, ``Timeline``, ``Backend``),
then ``Layouts`` (the backend), the ``ArenaKeeper`` (the backend), the ``Copier``
(layouts, keeper) and its fence hooks, the ``Flusher`` (keeper, copier), then the keeper's
two upward edges (``ArenaKeeper.connect``: ``Copier.wait_job``, ``Flusher.flush_newest``),
the ``Restorer`` (keeper, copier, ...), the ``EarlySaver``;
last the keeper takes the arena a previous process left, moves the old snapshots aside
(``fresh``) and starts a large arena's set-up. Each component receives the components
and callables it uses, never the Snapshotter. Once the facade made the triggers (the
coordinator and the guard, which take the facade), :func:`attach_triggers`.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..storage.protocol import Storage
from . import fences
from .arena_keeper import ArenaKeeper
from .arena_preparer import ArenaPreparer
from .backend import Backend
from .cadence import Cadence, clock_for
from .copier import Copier
from .counters import Counters
from .early import EarlySaver
from .flush import Flusher, FlushGuard, FlushRounds
from .options import Options
from .plan_cache import Layouts
from .restore import Coordinated, Restorer
from .state import TrainingState
from .timeline import Timeline

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


class Coordinator(FlushRounds, Coordinated, Protocol):
    """The distributed coordinator as the components see it (flush rounds, the restore)."""

    def attach_guard(self, guard: Guard | None) -> None: ...


class Guard(FlushGuard, Protocol):
    """The health guard as the components see it; started once they know it."""

    def start(self) -> None: ...


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
    hooks: list[RemovableHandle]  # the fence hooks' handles (close() removes them)


def wire(state: TrainingState, storage: Storage, opts: Options) -> Components:
    c = Counters()
    tl = Timeline()
    wait_s = opts.waits.copy_s
    a, d = opts.arena, opts.dist
    be = Backend(opts.copy.backend, opts.copy.threads, wait_s, a.path, a.device_staging)
    # Re-entrant: a signal handler may flush while the main thread is in boundary().
    flush_lock = threading.RLock()
    prep = ArenaPreparer(a.sync_max_bytes, be.state_device(state))
    keeper = ArenaKeeper(be, c, prep, storage, flush_lock, opts)
    # a plan's chunk: chunk_bytes, else the keeper's pick (its arena's when that one fits)
    lays = Layouts(state, be, c, chunk=keeper.chunk, rank=d.rank,
                   world_size=d.world_size, job=a.job)
    cp = Copier(state, be, lays, keeper, c, wait_timeout_s=wait_s,
                cadence=Cadence(opts.copy.snapshot_every, opts.copy.overhead_budget, clock_for(be)))
    hooks = fences.install(state, cp, lays.invalidate)
    flusher = Flusher(storage, keeper, cp, c, flush_lock, keep=opts.flush.keep,
                      flush_threads=opts.flush.threads)
    keeper.connect(wait_copy=cp.wait_job, flush=flusher.flush_newest)  # its regrowth
    restorer = Restorer(state, storage, keeper, cp, lays, tl, c, opts)
    early = EarlySaver(keeper, cp, lays, tl, c, flush_lock, waits=opts.waits)
    keeper.open_inherited()
    if opts.flush.fresh:
        keeper.start_fresh(d.world_size, d.rank)
    # As early as the state is known (issue 23 item 2): the set-up overlaps the rest of
    # the construction and whatever the program does before its first boundary.
    keeper.start_at_construction(state)  # large arenas: off the training thread
    return Components(c, tl, be, lays, keeper, cp, flusher, restorer, early, hooks)


def attach_triggers(parts: Components, dist: Coordinator | None, guard: Guard | None) -> None:
    """The distributed coordinator (or None) and the guard (or None), once made, handed to
    the components before any trigger can flush; then the guard starts, and last a large
    state's first layout build thread (parked)."""
    parts.flusher.attach(dist, guard)
    if dist is not None:
        dist.attach_guard(guard)  # its peer failures go through the guard
        parts.copier.cadence.coordinated()  # every rank copies the same boundaries
    parts.restorer.attach(dist, guard)
    parts.keeper.attach(coordinated=dist is not None)
    if guard is not None:
        guard.start()
    parts.layouts.prestart()
