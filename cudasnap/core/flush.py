"""Flush: write the newest COMPLETE snapshot (or, in zero-overhead mode, the live state) to disk.

A flush leases the slot it writes (the spare slot keeps boundaries going
meanwhile) and goes through ``self.storage`` (cudasnap.storage: POSIX or an
object store); in distributed mode the coordinator runs a flush round instead.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from ..errors import SnapshotError
from ..format import paths
from ..storage.progress import bytes_written, io_progress
from .shared import Fields

log = logging.getLogger("cudasnap")


class FlushMixin(Fields):
    def flush(self, wait: bool = True, timeout: float | None = 30.0) -> Path | None:
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
        if self._closed:
            raise SnapshotError("flush() on a closed Snapshotter")
        with self._flush_lock, (self.guard.paused() if self.guard is not None else contextlib.nullcontext()):
            if wait:
                self._wait_job(timeout)
            if self._live is not None:
                self._copy_live(timeout)
            if self.dist is not None:
                triggered = self.guard is not None and self.guard.dispatcher.flushing
                path = self.dist.flush(explicit=wait and not triggered)
                if path is not None:
                    self._stats.flushes += 1
                    self._stats.last_flush_path = str(path)
                    self._stats.last_flush_seconds = self.dist.last_flush["seconds"]
                return path
            arenas = self.staged_arenas()
            arena = arenas[0] if arenas else None
            if arena is None:
                log.warning("flush requested before the first snapshot: nothing to write")
                return None
            with self._slot_lock:
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
                                                       keep=self.keep)
            finally:
                arena.release(slot)
            self._stats.flushes += 1
            self._flushed_step = int(st["step"])
            self._stats.last_flush_seconds = st["seconds"]
            self._stats.last_flush_path = str(path)
            return path

    def settle_newest(self, timeout: float | None) -> None:
        """Zero-overhead mode: copies the newest boundary's live state now when that
        boundary was not copied and no optimizer step ran since (a no-op otherwise).
        The coordinator calls it while an explicit flush round waits for this rank's
        newest step (cudasnap.dist.flush_round)."""
        if self._live is not None:
            self._copy_live(timeout)

    def flush_if_new(self, wait_s: float = 60.0) -> Path | None:
        """Flushes the newest COMPLETE snapshot unless that step is already on disk
        (``close()``'s final flush); None when there was nothing new to write."""
        arenas = self.staged_arenas()
        if not arenas:
            return None
        self.wait(wait_s)
        with self._flush_lock:  # a triggered flush still running finishes first
            arena = arenas[0]
            slot = arena.newest_complete()
            if slot < 0:
                return None
            step = int(arena.slot_info(slot)["step"])
            if step == self._flushed_step or (
                    self.directory / paths.step_dirname(step) / paths.MANIFEST).is_file():
                return None
            return self.flush()

    def _copy_live(self, timeout: float | None) -> None:
        """Zero-overhead mode: the newest boundary was not copied; when no optimizer
        step (nor buffer forward, fence, load) ran since, the live tensors still hold
        that step, so copy them into a free slot now (same manifest, format and
        commit path) for the flush to write. Otherwise the newest COMPLETE slot is
        flushed (replay <= snapshot_every steps)."""
        live, arena = self._live, self._arena
        if live is None or arena is None or self._engine is None or self._live_copy is not None:
            return  # (not re-entered: a regrowth inside the copy flushes too)
        step, suffix = live
        ev = threading.Event()
        self._live_copy = ev  # set before reading the flag; _fence sets it the other way
        try:
            if self._live_dirty or self._live is not live:
                log.info("JIT flush: the state moved past step %d (optimizer step since); "
                         "flushing the newest copied snapshot", step)
                return
            if not self._wait_job(timeout):
                return
            try:
                lay = self._current_layout()
            except SnapshotError as e:
                log.warning("JIT flush: live state of step %d not copied: %s", step, e)
                return
            job = self._submit_copy(lay, step, suffix)
            if job is None or not self._wait_job(timeout if timeout is not None else
                                                 self.wait_timeout_s):
                return
            if self._live is live:
                self._live = None
            self._stats.live_saves += 1
            log.info("JIT flush: copied the live state of step %d (not snapshotted at its "
                     "boundary, snapshot_every=%d)", step, self.snapshot_every)
        finally:
            self._live_copy = None
            ev.set()
