"""The ArenaKeeper: the shared-memory arena a snapshot is copied into (adopt, create, retire).

One arena per rank, named by ``cudasnap.format.paths.arena_path``. A process
finds the arena its predecessor left (:meth:`ArenaKeeper.open_inherited`), adopts it or
makes a new one when the state first needs one (small arenas here, large ones in
the background: ``cudasnap.core.arena_prep``), and replaces it when the state
grows (:meth:`ArenaKeeper.retire`: the old one's newest snapshot goes to disk first).
It owns ``arena`` (the one copies go into), ``inherited`` (a predecessor's, until
adopted or dropped), ``prep`` (the background preparer) and ``lock`` (adoption and
creation), and gives the one answer to "does this plan fit" (:meth:`ArenaKeeper.ensure`).

Call order: the facade makes the keeper, then calls :meth:`open_inherited`,
:meth:`start_fresh` (``fresh=True``) and :meth:`start_at_construction`; once the
triggers exist, :meth:`attach`. The ``Copier`` calls :meth:`ensure` at a boundary
(skipped while the arena it returned still fits) and the ``EarlySaver`` with
``sync=True`` (a flush or close() before the arena is ready). ``close()`` calls
:meth:`shutdown`, then (after the engine stopped) :meth:`release`. Upward edges are
given as callables by :meth:`connect`: ``wait_copy`` (``Copier.wait_job``, before a
regrowth unmaps the old arena) and ``flush`` (``Flusher.flush_newest``: the old arena's
newest snapshot to disk; it copies nothing, so a regrowth never re-enters a copy).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._native import native
from .._proc import pid_alive
from ..errors import ConfigError, SnapshotError
from ..format import paths
from ..storage.fresh import move_aside
from . import arena_preparer
from .arena_exit import left_at_exit
from .arena_preparer import ArenaPreparer, Prepared, drop, fully_reserved
from .arena_size import estimate_meta_len, estimate_state_bytes
from .slot_geometry import arena_slots, chunk_for, meta_capacity, slot_capacity

if TYPE_CHECKING:
    from cudasnap._C import Arena, CancelFlag, CopyPlan

    from ..storage.protocol import Storage
    from .backend import Backend
    from .counters import Counters
    from .options import Options
    from .state import TrainingState

log = logging.getLogger("cudasnap")


class ArenaKeeper:
    def __init__(self, backend: Backend, counters: Counters, prep: ArenaPreparer,
                 storage: Storage, flush_lock: threading.RLock, opts: Options) -> None:
        self._backend, self._counters, self.prep = backend, counters, prep
        a = opts.arena
        self.arena_path, self.slots, self.spare_slot = a.path, a.slots, a.spare_slot
        self.chunk_bytes, self.job, self.storage = a.chunk_bytes, a.job, storage
        self.directory = storage.local_dir  # the fresh start's move (local: never a URL)
        self.flush_threads, self._waits = opts.flush.threads, opts.waits
        self._supervised = opts.dist.supervised  # under `cudasnap run` (its supervisor handles a left arena)
        self._flush_lock = flush_lock  # an arena is never unmapped under a flush of it
        self._wait_copy: Callable[[float], bool] = lambda timeout: True  # connect()
        self._flush: Callable[[float | None], object] = lambda timeout: None
        self.arena: Arena | None = None
        self.inherited: Arena | None = None
        self.lock = threading.RLock()  # adoption/creation: ensure(), a synchronous snapshot
        self._coordinated = False  # multi-rank: flushes are coordinated (no lone flush)
        self._planned: tuple[int, int] | None = None  # (capacity, chunk) being prepared, not taken

    def connect(self, wait_copy: Callable[[float], bool],
                flush: Callable[[float | None], object]) -> None:
        """The two upward edges, once the copier and the flusher exist (before any arena):
        ``wait_copy`` (``Copier.wait_job``: a copy into the old arena ends before a
        regrowth unmaps it) and ``flush`` (``Flusher.flush_newest``: its newest snapshot to
        disk first)."""
        self._wait_copy, self._flush = wait_copy, flush

    def attach(self, coordinated: bool) -> None:
        """After the triggers exist: whether a distributed coordinator runs the flushes."""
        self._coordinated = coordinated

    # ----------------------------------------------------------------- facts
    def staged_arenas(self) -> list[Arena]:
        """This rank's open arenas: its own, then one inherited from a predecessor."""
        return [a for a in (self.arena, self.inherited) if a is not None]

    def stats(self) -> dict[str, object]:
        """``stats()``'s arena fields: where it lives, how it is pinned, its slots."""
        arenas = self.staged_arenas()
        a = arenas[0] if arenas else None
        cuda = self._backend.cuda
        s: dict[str, object] = {"staging": None if a is None else {
            "path": a.path, "bytes": a.total_bytes, "shared": a.shared,
            "page_locked": a.cuda_registered, "huge_pages": a.huge_pages,
            # False: a process-private arena (a crash of this process loses the snapshot).
            "survives_crash": bool(a.shared),
            # Why the arena is process-private (cudaHostRegister of the shared file refused).
            "fallback_reason": self.prep.fallback_reason or (
                cuda.fallback_reason if cuda is not None else None)}}
        s["arena_preparing"] = self.prep.pending
        s.update(arena_slots(a, self.slots, self.spare_slot))
        return s

    def ready(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout`` s) for a background arena set-up; True when none runs."""
        return self.prep.wait(timeout)

    def _fits(self, arena: Arena, nbytes: int, meta_len: int, chunk: int) -> bool:
        return (arena.data_capacity >= nbytes and arena.meta_capacity >= meta_len
                and arena.chunk_bytes == chunk and arena.num_slots == self.slots)

    def chunk(self, nbytes: int) -> int:
        """The chunk size of a copy plan (cudasnap.core.copy_plan.make_plan) or an arena for a
        slot of ``nbytes``: the Snapshotter's ``chunk_bytes``; else (None: it follows the
        state) the chunk of the arena in use, the inherited one or the one being prepared
        when its slots hold ``nbytes`` (any chunk is valid: that arena is then used, not
        made again), else ``chunk_for(nbytes)`` (cudasnap.core.slot_geometry)."""
        if self.chunk_bytes:
            return self.chunk_bytes
        for cap, chunk in ((a.data_capacity, a.chunk_bytes) for a in (self.arena, self.inherited)
                           if a is not None and a.num_slots == self.slots):
            if cap >= nbytes:
                return int(chunk)
        planned = self._planned
        if planned is not None and planned[0] >= nbytes:
            return planned[1]
        return chunk_for(nbytes)

    def _device(self) -> int | None:
        cuda = self._backend.cuda
        return cuda.index if cuda is not None else self.prep.device

    # ---------------------------------------------------------- construction
    def open_inherited(self) -> None:
        """The arena a previous process left at ``arena_path`` becomes ``inherited``."""
        if not self.arena_path.exists():
            return
        C = native()
        try:  # pre-faulted by start_at_construction (large: in the background)
            arena = C.Arena.open(str(self.arena_path), True, False)
        except SnapshotError as e:
            log.warning("ignoring unreadable staging arena %s: %s", self.arena_path, e)
            self.arena_path.unlink(missing_ok=True)
            return
        owner = arena.owner_pid
        if owner != os.getpid() and pid_alive(owner):
            raise ConfigError(f"staging arena {self.arena_path} belongs to running process {owner}")
        arena.claim_owner()  # from now on `cudasnap gc` sees this process as the user
        if not self._supervised:
            left_at_exit(arena.path)  # named at exit if still there (issue 23 item 6)
        self.inherited = arena
        slot = arena.newest_complete()
        if slot >= 0:
            info = arena.slot_info(slot)
            log.info("found snapshot of step %d in shared memory (%s), left by pid %d",
                     info["step"], self.arena_path, info["writer_pid"])

    def start_fresh(self, world_size: int, rank: int) -> None:
        """``fresh=True``: snapshots (and the inherited arena's newest) go aside, then the
        inherited arena is removed (cudasnap.storage.fresh.move_aside)."""
        move_aside(self.directory, self.inherited, self.flush_threads,
                   None if world_size == 1 else paths.rank_dirname(rank))
        if self.inherited is not None:
            self.inherited.unlink()
            self.inherited = None

    def start_at_construction(self, state: TrainingState) -> None:
        """Starts preparing the arena now when it is too large to make at a boundary:
        the inherited one (pre-fault, register) or a new one sized from the state.

        An inherited arena on the CPU backend whose pages are all reserved is usable at
        once (issue 23 item 2: snapshots from the first boundary after a restart); only
        its pre-fault runs in the background, beside the copies into it."""
        prep = self.prep
        inh = self.inherited
        if inh is not None:
            desc = (f"the staging arena left by the previous process ({inh.path}, "
                    f"{inh.total_bytes / 2**30:.2f} GiB)")
            if inh.num_slots * inh.data_capacity <= prep.sync_max_bytes:
                inh.prefault()  # small: as before, here (CUDA registration at adoption)
                prep.warmed = inh
            elif prep.device is None and fully_reserved(inh):
                prep.warmed = inh  # adopted by the first boundary that fits
                prep.start(desc, None, speculative=True,
                           then=lambda _a, cancel: inh.prefault(cancel))
            else:
                prep.start(desc, arena_preparer.warm_job(inh, prep.device), speculative=True)
            return
        nbytes, ntensors = estimate_state_bytes(state)
        chunk = self.chunk(nbytes)
        cap = slot_capacity(nbytes, chunk)
        meta_cap = meta_capacity(estimate_meta_len(ntensors), nbytes)
        total = native().Arena.required_bytes(self.slots, cap, meta_cap, chunk)
        if self.slots * nbytes > prep.sync_max_bytes:
            self._start_create(self._what(total), cap, meta_cap, chunk, prep.device,
                               speculative=True)

    # --------------------------------------------------------------- ensure()
    def ensure(self, plan: CopyPlan, meta_len: int, step: int, sync: bool = False) -> Arena | None:
        """The arena for a snapshot of ``plan``, or None (boundary skipped: not ready yet).

        Small arenas are made here, synchronously; large ones (and the pre-fault and
        registration of an inherited one) by the background preparer. ``sync`` (a flush,
        trigger or close() before the arena is ready: cudasnap.core.early): whatever the
        size, the arena is made or adopted here, now (a running set-up is waited for or
        cancelled first). Holds ``lock``: a boundary that finds it taken (a synchronous
        set-up on another thread) is skipped, never blocked.
        """
        lock = self.lock
        if not lock.acquire(timeout=self._waits.copy_s if sync else 0):
            if sync:
                log.error("cudasnap: the staging arena stayed busy for %.0f s",
                          self._waits.copy_s)
            else:
                self._not_ready(step)
            return None
        try:
            return self._ensure(plan, meta_len, step, sync)
        finally:
            lock.release()

    def _ensure(self, plan: CopyPlan, meta_len: int, step: int, sync: bool) -> Arena | None:
        prep = self.prep
        if prep.pending:
            if not sync:
                self._not_ready(step)
                return None
            self._settle()
            if prep.pending:
                return None
        got = prep.take()  # raises the background set-up's error (once)
        if got is not None:
            self._planned = None  # adopted or dropped below: its chunk is no one's pick
        nbytes, chunk = plan.total_bytes, int(plan.chunk_bytes)
        a = self.arena
        if a is not None and a.data_capacity >= nbytes and a.meta_capacity >= meta_len \
                and a.chunk_bytes == chunk:  # (a new chunk: the state grew or shrank a lot)
            drop(got.arena if got is not None and got.created else None)
            return a
        discard = None
        if got is not None and got.arena is not None:
            if a is None and self._fits(got.arena, nbytes, meta_len, chunk) and (
                    self._backend.cuda is None or got.arena.cuda_registered):
                return self._adopt_prepared(got)
            if got.created:
                discard = got.arena  # too small or not page-locked: made again below
            elif got.arena is not self.inherited:
                drop(got.arena)
        del got
        need_meta = meta_capacity(meta_len, nbytes)
        inh = self.inherited
        if a is None and inh is not None and self._fits(inh, nbytes, need_meta, chunk):
            if prep.warmed is inh or inh.num_slots * inh.data_capacity <= prep.sync_max_bytes \
                    or sync:
                if prep.warmed is not inh and not (sync and fully_reserved(inh)):
                    inh.prefault()  # (sync: only its holes are reserved and mapped)
                self.inherited = None
                self.arena = self.adopt(inh)  # CUDA: page-locked here when not yet
                return self.arena
            prep.start(f"the staging arena left by the previous process ({inh.path})",
                       arena_preparer.warm_job(inh, self._device()))
            self._not_ready(step)
            return None
        cap = slot_capacity(nbytes, chunk)
        total = native().Arena.required_bytes(self.slots, cap, need_meta, chunk)
        regrow = a is not None
        del a, inh  # the old mapping must go before the new arena's free-space check
        if not sync and (self.slots * nbytes > prep.sync_max_bytes or discard is not None):
            if regrow:
                log.warning("state grew to %d bytes; re-creating the staging arena in the "
                            "background", nbytes)
            self._start_create(self._what(total), cap, need_meta, chunk, self._device(),
                               retire=regrow, drop_inherited=self.inherited is not None,
                               discard=discard)
            self._not_ready(step)
            return None
        drop(discard)
        # sync (large): reserved only, not pre-faulted (the copy maps the pages it writes)
        return self._make_here(regrow, cap, need_meta, chunk, prefault=not sync)

    def _not_ready(self, step: int) -> None:
        self._counters.skipped_not_ready += 1
        self.prep.note_skip(step)

    def _what(self, total: int) -> str:
        return f"the staging arena ({self.slots} slots, {total / 2**30:.2f} GiB)"

    def _settle(self) -> None:
        """``ensure(sync=True)`` while a set-up's job runs: a job at work is waited for (it
        is further along than a new start here would be); one not started yet (held) is
        cancelled, and the caller makes the arena itself."""
        prep = self.prep
        if prep.started:
            log.warning("cudasnap: waiting for %s (the synchronous snapshot needs it)",
                        prep.what)
            if not prep.wait_handed(self._waits.copy_s):
                log.error("cudasnap: %s was not ready after %.0f s", prep.what,
                          self._waits.copy_s)
            return
        prep.cancel(self._waits.close_s)

    def _adopt_prepared(self, got: Prepared) -> Arena:
        if got.arena is self.inherited:
            self.inherited = None
        elif got.created is False and self.inherited is not None:
            self.inherited = None  # its private pinned replacement (register refused)
        self._counters.arena_setup_seconds = got.seconds
        assert got.arena is not None  # (the caller adopts a set-up that made one)
        self.arena = a = self.adopt(got.arena)
        log.info("staging arena %s: %d slots x %.1f MB, set up in %.2f s off the training "
                 "thread", a.path, a.num_slots, a.data_capacity / 1e6, got.seconds)
        return a

    def _start_create(self, what: str, capacity: int, meta_cap: int, chunk: int,
                      device: int | None, *,
                      speculative: bool = False, retire: bool = False,
                      drop_inherited: bool = False, discard: Arena | None = None) -> None:
        self._planned = (capacity, chunk)  # a plan made meanwhile takes its chunk (chunk())

        def job(cancel: CancelFlag) -> tuple[Arena | None, str | None, bool]:
            drop(discard)
            if retire and not self.retire():
                return None, None, False  # a copy into the old arena still runs: retry later
            if drop_inherited:
                with self._flush_lock:  # never under a running flush of it
                    inh, self.inherited = self.inherited, None
                    drop(inh)
                    del inh
            self.arena_path.unlink(missing_ok=True)
            # CPU: usable once reserved; its pages are mapped by the follow-up
            # (prefault_then) while snapshots already use it. CUDA: page-locked before
            # any copy.
            arena = self.create_arena(capacity, meta_cap, chunk, cancel, device is not None)
            try:
                got, reason = arena_preparer.pin(arena, device)
            except BaseException:
                arena.unlink()
                raise
            return got, reason, True

        self.prep.start(what, job, speculative=speculative,
                        then=arena_preparer.prefault_then if device is None else None)

    def _make_here(self, regrow: bool, capacity: int, meta_capacity: int, chunk: int,
                   prefault: bool = True) -> Arena | None:
        """An arena made on the calling thread: a small one at a boundary, or any size for
        a synchronous snapshot before the background one was ready (cudasnap.core.early;
        ``prefault`` False: reserved, its pages mapped by the copies that write them)."""
        if regrow:
            log.warning("state grew; re-creating the staging arena")
            if not self.retire():
                return None
        if self.inherited is not None:
            drop(self.inherited)
            self.inherited = None
        t0 = time.perf_counter()
        self.arena_path.unlink(missing_ok=True)
        arena = self.create_arena(capacity, meta_capacity, chunk, None, prefault)
        self.arena = self.adopt(arena)
        secs = self._counters.arena_setup_seconds = time.perf_counter() - t0
        log.info("staging arena %s: %d slots x %.1f MB, set up in %.2f s", self.arena_path,
                 self.slots, capacity / 1e6, secs)
        return self.arena

    def create_arena(self, capacity: int, meta_capacity: int, chunk: int,
                     cancel: CancelFlag | None = None, prefault: bool = True) -> Arena:
        return native().Arena.create(str(self.arena_path), self.slots, capacity,
                                     meta_capacity, chunk, self.job, prefault, cancel)

    def retire(self) -> bool:
        """Frees the current arena before a bigger one is made, keeping its snapshot.

        /dev/shm must hold only one arena at a time, so the old one is released
        (unregistered, unlinked, unmapped) first. Its newest COMPLETE snapshot
        is written to disk beforehand unless the disk already has that step: a
        crash before the new arena holds a COMPLETE snapshot then still finds
        it. False (the boundary is skipped) while a copy into it still runs.
        """
        if not self._wait_copy(self._waits.copy_s):
            log.warning("staging arena not re-created: a copy into the old one is still running")
            return False
        old = self.arena
        if old is None:
            return True  # (nothing to retire)
        slot = old.newest_complete()
        if slot >= 0:
            step = old.slot_info(slot)["step"]
            if self._coordinated:
                log.warning("state grew: the in-memory snapshot of step %d is dropped with the "
                            "old staging arena (multi-rank flushes are coordinated; flush "
                            "before the state grows to keep it)", step)
            elif not self.storage.has_step(step):
                log.warning("state grew: writing the snapshot of step %d to disk before its "
                            "staging arena is replaced", step)
                self._flush(self._waits.copy_s)
        cuda = self._backend.cuda
        if cuda is not None and not cuda.release_arena(old, self._waits.copy_s):
            return False
        with self._flush_lock:  # may run on the arena preparer: never under a flush
            old.unlink()
            self.arena = None
            del old  # drops the mapping (the engine holds none once idle)
        self._counters.arena_regrowths += 1
        return True

    def adopt(self, arena: Arena) -> Arena:
        """``arena`` taken into use: owned (for `cudasnap gc`), named at exit, page-locked."""
        if arena.writable:
            arena.claim_owner()  # `cudasnap gc` must see this process as the live user
        if arena.shared and not self._supervised:
            left_at_exit(arena.path)  # named at exit if still there (issue 23 item 6)
        cuda = self._backend.cuda
        if cuda is not None:
            return cuda.prepare_arena(arena, self, self.prep.fallback_reason)
        return arena

    # ----------------------------------------------------------------- close
    def shutdown(self, timeout: float) -> None:
        """close(): stops a running set-up (bounded) and removes an arena made but never
        adopted (it holds no snapshot)."""
        prep = self.prep
        if prep.busy:
            prep.cancel(timeout)
        try:
            got = prep.take()
        except Exception as e:  # cancelled (or failed): a cancelled create removes its file
            log.info("cudasnap: arena set-up stopped by close(): %s", e)
            got = None
        if got is not None and got.created and got.arena is not None \
                and got.arena is not self.arena:
            drop(got.arena)

    def release(self, unlink: bool) -> None:
        """close(): drops the arenas, removing their files unless ``unlink`` is False."""
        for a in self.staged_arenas():
            if unlink:
                a.unlink()
        self.arena = self.inherited = None
