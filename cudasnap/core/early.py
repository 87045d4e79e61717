"""The EarlySaver: snapshots before the staging arena is ready.

Before the arena is ready (issue 23 item 2). A large arena is made (or an inherited
one warmed) on a background thread from construction on (cudasnap.core.arena_prep);
boundaries until then are skipped. Each skipped boundary still records its host
state (``Copier.live``, a ``PendingBoundary``), so that the live tensors, as long as no optimizer step
ran since, ARE that step. A flush (explicit, or a trigger's: SIGUSR1, SIGTERM, a
health event, the hang watchdog) or ``close()`` arriving meanwhile calls
:meth:`EarlySaver.before_flush` / :meth:`EarlySaver.at_close`: the arena is made (or
adopted) right there, synchronously (``ArenaKeeper.ensure(sync=True)``: a set-up already
at work is waited for, one not started is cancelled), and the live state is copied into
it (the JIT live copy of zero-overhead mode, ``Copier.copy_live``); the flush then writes it.
When the state has moved on (an optimizer step since the boundary), a trigger's
flush waits (bounded by its timeout) for the next boundary, which snapshots into the
arena now ready. At most one step is lost either way. ``close()`` with nothing of
the attempt saved says so in a WARNING (:meth:`EarlySaver.warn_if_nothing_saved`).

Call order: the facade's ``flush()`` calls ``before_flush`` first, ``close()`` calls
``at_close`` then ``warn_if_nothing_saved``; ``boundary()`` calls
:meth:`EarlySaver.boundary_done` after its copy was handed over (it records the step and
wakes a waiting flush). The copier records the skipped boundary (``PendingBoundary.record``).
A regrowth inside ``save_now`` (the arena replaced while made synchronously) writes the
old arena's snapshot through ``Flusher.flush_newest``, never through ``flush()``: nothing
here is re-entered.

An arena left at exit: :mod:`cudasnap.core.arena_exit`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..errors import SnapshotError

if TYPE_CHECKING:
    from .arena_keeper import ArenaKeeper
    from .copier import Copier
    from .counters import Counters
    from .options import Waits
    from .plan_cache import Layouts
    from .timeline import Timeline

log = logging.getLogger("cudasnap")


# ------------------------------------------------ before the arena is ready
class EarlySaver:
    def __init__(self, keeper: ArenaKeeper, copier: Copier, layouts: Layouts,
                 timeline: Timeline, counters: Counters, flush_lock: threading.RLock, *,
                 waits: Waits) -> None:
        self._keeper, self._copier, self._layouts = keeper, copier, layouts
        self._timeline, self._counters, self._flush_lock = timeline, counters, flush_lock
        self._waits = waits
        self.boundary_event: threading.Event | None = None  # set by the next boundary
        # The step of the newest boundary() that returned past its copy (or skip): what a
        # flush waiting for "the next boundary" compares with, not Timeline.last_step,
        # which boundary() advances before its copy is handed over.
        self.done_step: int | None = None

    def boundary_done(self, step: int) -> None:
        """``boundary()``, after its copy was handed over (or skipped): a flush waiting for
        the boundary after the newest one may go on."""
        self.done_step = step
        ev = self.boundary_event
        if ev is not None:
            ev.set()

    def _needs_arena(self) -> bool:
        """The newest boundary is in no arena and a flush could not copy it now."""
        return self._copier.live.pending() is not None and (
            self._keeper.arena is None or self._keeper.prep.pending)

    def save_now(self, timeout: float | None, why: str) -> bool:
        """Makes (or adopts) the arena on this thread and copies the live state of the newest
        boundary into it. True when that step is now COMPLETE in the arena."""
        copier = self._copier
        live = copier.live.pending()
        if live is None or not self._needs_arena():
            return False
        lock = self._keeper.lock
        # Another thread's synchronous save holds it: wait for that one, within this
        # caller's own bound (a trigger's flush has 0-5 s), then copy whatever is left.
        bound = self._waits.copy_s if timeout is None else min(timeout, self._waits.copy_s)
        if not lock.acquire(timeout=bound):
            log.error("cudasnap: %s before the staging arena was ready, and it stayed busy for "
                      "%.1f s: nothing snapshotted", why, bound)
            return False
        try:
            # Lock order: the keeper's lock, then the flush lock (a background regrowth,
            # waited for inside ensure(), takes the flush lock itself: not held here yet).
            step, suffix = live
            try:
                lay = self._layouts.current()
                arena = self._keeper.ensure(lay.plan, lay.prefix_len + len(suffix), step,
                                            sync=True)
            except SnapshotError as e:
                log.error("cudasnap: %s before the staging arena was ready, and it could not "
                          "be made now: %s", why, e)
                return False
            if arena is None:
                return False
            if copier.live.pending() is not live or not copier.live.clean():
                return False  # moved on meanwhile: the caller waits for the next boundary
            before = self._counters.live_saves
            with self._flush_lock:
                copier.copy_live(timeout)
            if self._counters.live_saves == before:
                return False
            self._counters.early_saves += 1
            log.warning("cudasnap: %s before the staging arena was ready: step %d snapshotted "
                        "synchronously from the live state", why, step)
            return True
        finally:
            lock.release()

    def before_flush(self, timeout: float | None) -> None:
        """``flush()``: the newest boundary was skipped (arena not ready): snapshot it now.

        The live state past that boundary (an optimizer step ran since): on another thread
        than the training loop's (a trigger), the arena is made and the next boundary,
        which snapshots into it, is waited for (up to ``timeout``), so the flush writes it;
        on the training thread itself the flush writes what there is (the arena is ready
        for the next boundaries)."""
        if not self._needs_arena() or self.save_now(timeout, "flush requested"):
            return
        state = self._copier.live
        live = state.pending()  # read once: the boundary we wait past
        if live is None or state.clean() or self._keeper.arena is None \
                or state.unprotected_here():
            return
        _wait_next_boundary(self, live[0], self._waits.copy_s if timeout is None else timeout)

    def at_close(self, keep: bool) -> None:
        """``close()`` before the arena was ready: the newest boundary goes into an arena
        made now (flushed by close's final flush, or kept for a restart when ``keep``).
        A boundary not copied (the cadence skipped it, or its plan was being built) is
        copied now, unless the state moved past it."""
        timeout = self._waits.close_s
        if self._needs_arena() and self._copier.live.clean():
            self.save_now(timeout, "close()" if not keep else "close(keep_arena=True)")
        self._copier.settle_deferred(timeout)

    def warn_if_nothing_saved(self) -> None:
        """``close()``: boundaries ran but none of them was saved anywhere: say so."""
        st, tl = self._counters, self._timeline
        if tl.boundaries and st.skipped_not_ready and not st.snapshots and not st.live_saves:
            log.warning("cudasnap: close(): none of this run's %d boundaries (last step %s) "
                        "was saved: the staging arena was not ready yet (%d skipped) and the "
                        "state had moved past the last boundary; a restart resumes from the "
                        "previous snapshot, if any", tl.boundaries, tl.last_step,
                        st.skipped_not_ready)


def _wait_next_boundary(early: EarlySaver, step: int, timeout: float) -> None:
    """Until a boundary after ``step`` (the one in ``Copier.live``) has handed over its copy
    (it snapshots into the arena now ready, or, skipped, leaves its live state to copy),
    bounded by ``timeout``."""
    copier = early._copier
    ev = threading.Event()
    early.boundary_event = ev  # before the check below: no boundary slips between
    deadline = time.monotonic() + timeout
    try:
        log.warning("cudasnap: flush requested mid-step before the staging arena was ready: "
                    "waiting up to %.0f s for the boundary after step %d", timeout, step)
        while early.done_step is None or early.done_step <= step:
            left = deadline - time.monotonic()
            if left <= 0 or not ev.wait(left):
                log.error("cudasnap: no boundary within %.0f s: the flush writes no newer "
                          "step", timeout)
                return
            ev.clear()
        if early._needs_arena() and copier.live.clean():  # that boundary found no arena
            early.save_now(timeout, "flush requested")
    finally:
        early.boundary_event = None
