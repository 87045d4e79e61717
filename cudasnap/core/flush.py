"""Flush: write the newest COMPLETE snapshot (or, in zero-overhead mode, the live state) to disk.

A flush leases the slot it writes (the spare slot keeps boundaries going
meanwhile) and goes through ``storage`` (cudasnap.storage: POSIX or an
object store); in distributed mode the coordinator runs a flush round instead.

Call order: the facade makes the ``Flusher`` with the flush lock it also hands the
keeper and the early saver, and calls :meth:`Flusher.attach` once the triggers exist.
``Snapshotter.flush()`` (explicit, a trigger's) runs the early saver first, then
:meth:`Flusher.flush`: under the flush lock, ``Copier.wait_job`` (with ``wait``),
``Copier.copy_live`` (a boundary not copied), then the coordinator's round or
:meth:`Flusher.flush_newest`: the newest COMPLETE slot leased under the copier's slot lock
and written by the storage. ``ArenaKeeper.retire`` (a regrowth) calls
:meth:`Flusher.flush_newest` itself: the old arena's newest snapshot, nothing copied
first. ``close()`` calls :meth:`Flusher.final_flush` (:meth:`Flusher.flush_if_new`).
Nothing here calls back into the facade.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..config import FINAL_FLUSH_WAIT_S, FLUSH_WAIT_S
from ..errors import SnapshotError
from ..storage.progress import bytes_written, io_progress
from ..storage.protocol import Storage

if TYPE_CHECKING:
    from .arena_keeper import ArenaKeeper
    from .copier import Copier
    from .counters import Counters

log = logging.getLogger("cudasnap")


class FlushRounds(Protocol):
    """The coordinator's flush rounds (``cudasnap.distributed.coordinator``)."""

    def flush(self, explicit: bool = False, timeout: float | None = None) -> Path | None: ...

    @property
    def last_flush(self) -> Mapping[str, object] | None: ...


class Flushing(Protocol):
    """The trigger dispatcher: whether a trigger's flush runs (``triggers.dispatch``)."""

    @property
    def flushing(self) -> bool: ...


class FlushGuard(Protocol):
    """The health guard (``cudasnap.triggers.guard``) as a flush sees it."""

    @property
    def dispatcher(self) -> Flushing: ...

    def paused(self) -> AbstractContextManager[None]: ...


class Flusher:
    def __init__(self, storage: Storage, keeper: ArenaKeeper, copier: Copier, counters: Counters,
                 flush_lock: threading.RLock, *, keep: int, flush_threads: int) -> None:
        self.storage, self._keeper, self._copier = storage, keeper, copier
        self._counters, self.lock = counters, flush_lock
        self.keep, self.flush_threads = keep, flush_threads
        self.flushed_step: int | None = None  # the newest step this process wrote
        self._dist: FlushRounds | None = None
        self._guard: FlushGuard | None = None

    def attach(self, dist: FlushRounds | None, guard: FlushGuard | None) -> None:
        """After the triggers exist: the coordinator (multi-rank flush rounds) and the
        guard (paused while a flush runs)."""
        self._dist, self._guard = dist, guard

    def _paused(self) -> AbstractContextManager[None]:
        guard = self._guard
        return guard.paused() if guard is not None else contextlib.nullcontext()

    def flush(self, wait: bool = True, timeout: float | None = FLUSH_WAIT_S) -> Path | str | None:
        """Writes the newest COMPLETE snapshot to disk now; returns its directory.

        With ``wait`` the running copy (if any) is given ``timeout`` seconds to
        complete first, so the flushed step is the newest one. Returns None when
        no snapshot exists yet.

        Multi-rank: called by the program itself with ``wait`` (e.g. at the end of the
        job, on every rank), the coordinated round waits, bounded, for every live rank's
        copy of this rank's newest step, so all agree on the last step every rank
        reached. A trigger's flush (the guard's: signals, health, peer failure) or one
        without ``wait`` waits for no rank's boundary.
        """
        guard, dist, copier = self._guard, self._dist, self._copier
        with self.lock, self._paused():
            if wait:
                copier.wait_job(timeout)
            copier.copy_live(timeout)
            if dist is None:
                return self.flush_newest(timeout)
            triggered = guard is not None and guard.dispatcher.flushing
            path = dist.flush(explicit=wait and not triggered, timeout=timeout)
            done = dist.last_flush
            if path is not None and done is not None:
                self._counters.flushes += 1
                self._counters.last_flush_path = str(path)
                self._counters.last_flush_seconds = float(done["seconds"])  # type: ignore[arg-type]
            return path

    def flush_newest(self, timeout: float | None = None) -> Path | str | None:
        """This rank's newest COMPLETE slot to disk, as it is (nothing copied or waited for
        first; no round): a flush's last step, and ``ArenaKeeper.retire``'s write of the
        old arena before a regrowth. None when no COMPLETE slot exists. ``timeout`` bounds
        the storage's waits on other writers (``Storage.write_slot``)."""
        with self.lock, self._paused():
            arenas = self._keeper.staged_arenas()
            arena = arenas[0] if arenas else None
            if arena is None:
                log.warning("flush requested before the first snapshot: nothing to write")
                return None
            with self._copier.slot_lock:
                slot = arena.newest_complete()
                if slot < 0:
                    log.warning("flush requested but no COMPLETE snapshot exists yet")
                    return None
                arena.lease(slot)
            try:
                nbytes = arena.slot_info(slot)["data_bytes"]
                with io_progress(nbytes, f"cudasnap flush step {arena.slot_info(slot)['step']}",
                                 bytes_written):
                    path, st = self.storage.write_slot(arena, slot, threads=self.flush_threads,
                                                       keep=self.keep, timeout=timeout)
            finally:
                arena.release(slot)
            self._counters.flushes += 1
            self.flushed_step = int(st["step"])
            self._counters.last_flush_seconds = st["seconds"]
            self._counters.last_flush_path = str(path)
            return path

    def settle_newest(self, timeout: float | None) -> None:
        """A boundary not copied: copies its live state now when no optimizer step ran
        since (a no-op otherwise). The coordinator calls it while an explicit flush round
        waits for this rank's newest step (cudasnap.distributed.flush_round)."""
        self._copier.copy_live(timeout)

    def flush_if_new(self, wait_s: float = FINAL_FLUSH_WAIT_S) -> Path | str | None:
        """Flushes the newest COMPLETE snapshot unless that step is already stored;
        None when there was nothing new."""
        arenas = self._keeper.staged_arenas()
        if not arenas:
            return None
        self._copier.wait_job(wait_s)
        with self.lock:  # a triggered flush still running finishes first
            arena = arenas[0]
            slot = arena.newest_complete()
            if slot < 0:
                return None
            step = int(arena.slot_info(slot)["step"])
            # one rank: the storage's own listing (an object store's for a URL); several:
            # every rank takes part in the round, as it always did
            if step == self.flushed_step or (self._dist is None and self.storage.has_step(step)):
                return None
            return self.flush()

    def final_flush(self) -> bool:
        """``close()`` with ``flush_on_close``: flushes the newest snapshot unless that step
        is already stored. False when the flush failed (the caller then keeps the arena)."""
        arenas = self._keeper.staged_arenas()
        if not arenas:
            return True
        try:
            self.flush_if_new(FINAL_FLUSH_WAIT_S)
            return True
        except SnapshotError as e:
            log.error("close(): the final flush failed (%s); the arena %s is kept", e,
                      arenas[0].path)
            return False
