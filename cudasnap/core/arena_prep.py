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
  ``Snapshotter._retire_arena``) and the new one made, in the background.

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

Split (issue 24): this module is the Snapshotter's side, the policy of when and what to set
up; :mod:`cudasnap.core.arena_size` sizes the arena (``estimate_state_bytes``, slot and
manifest capacities) and :mod:`cudasnap.core.arena_preparer` runs the set-up
(``ArenaPreparer``, ``Prepared``, ``pin``, ``drop``; importable from here too).

Call order: the Snapshotter's constructor makes ``snap._prep`` (an ``ArenaPreparer``) and
calls :func:`start_at_construction`; each boundary (``core.staging``) and a flush, trigger or
``close()`` before the arena is ready (``core.early``, ``sync=True``) call :func:`ensure`,
which adopts a finished set-up, makes a small arena there and then, or starts a background
one; ``close()`` calls :func:`shutdown`.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .._native import native
from .arena_preparer import ArenaPreparer, Prepared, drop, pin
from .arena_size import estimate_meta_len, estimate_state_bytes, meta_capacity, slot_capacity

log = logging.getLogger("cudasnap")

SYNC_MAX_BYTES = 16 << 20


# ------------------------------------------------- the Snapshotter's side
def _fits(arena: Any, snap: Any, nbytes: int, meta_len: int) -> bool:
    return (arena.data_capacity >= nbytes and arena.meta_capacity >= meta_len
            and arena.chunk_bytes == snap.chunk_bytes and arena.num_slots == snap.num_slots)


def fully_reserved(arena: Any) -> bool:
    """Every page of ``arena``'s file is allocated (a set-up that crashed half-way
    leaves holes: a copy into one could SIGBUS when /dev/shm is full)."""
    try:
        st = os.stat(arena.path)
    except OSError:
        return False
    return st.st_blocks * 512 >= arena.total_bytes


def _prefault_then(arena: Any, cancel: Any) -> None:
    """Follow-up of a CPU arena already in use: maps its pages (content untouched)."""
    if arena is not None:
        arena.prefault(cancel)


def _warm_job(arena: Any, device: int | None) -> Callable[[Any], tuple[Any, str | None, bool]]:
    def job(cancel: Any) -> tuple[Any, str | None, bool]:
        arena.prefault(cancel)
        got, reason = pin(arena, device)
        return got, reason, False
    return job


def _create_job(snap: Any, capacity: int, meta_cap: int, device: int | None, *,
                retire: bool, drop_inherited: bool,
                discard: Any) -> Callable[[Any], tuple[Any, str | None, bool]]:
    def job(cancel: Any) -> tuple[Any, str | None, bool]:
        drop(discard)
        if retire and not snap._retire_arena():
            return None, None, False  # a copy into the old arena still runs: retry later
        if drop_inherited:
            with snap._flush_lock:  # never under a running flush of it
                inh, snap._inherited = snap._inherited, None
                drop(inh)
                del inh
        snap.arena_path.unlink(missing_ok=True)
        # CPU: usable once reserved; its pages are mapped by the follow-up (_prefault_then)
        # while snapshots already use it. CUDA: page-locked before any copy.
        arena = snap._create_arena(capacity, meta_cap, cancel, device is not None)
        try:
            got, reason = pin(arena, device)
        except BaseException:
            arena.unlink()
            raise
        return got, reason, True
    return job


def _start_create(prep: ArenaPreparer, snap: Any, what: str, capacity: int, meta_cap: int,
                  device: int | None, *, speculative: bool = False, retire: bool = False,
                  drop_inherited: bool = False, discard: Any = None) -> None:
    prep.start(what, _create_job(snap, capacity, meta_cap, device, retire=retire,
                                 drop_inherited=drop_inherited, discard=discard),
               speculative=speculative, then=_prefault_then if device is None else None)


def start_at_construction(snap: Any) -> None:
    """Starts preparing the arena now when it is too large to make at a boundary:
    the inherited one (pre-fault, register) or a new one sized from the state.

    An inherited arena on the CPU backend whose pages are all reserved is usable at
    once (issue 23 item 2: snapshots from the first boundary after a restart); only
    its pre-fault runs in the background, beside the copies into it."""
    prep: ArenaPreparer = snap._prep
    inh = snap._inherited
    if inh is not None:
        desc = (f"the staging arena left by the previous process ({inh.path}, "
                f"{inh.total_bytes / 2**30:.2f} GiB)")
        if inh.num_slots * inh.data_capacity <= prep.sync_max_bytes:
            inh.prefault()  # small: as before, here (CUDA registration at adoption)
            prep.warmed = inh
        elif prep.device is None and fully_reserved(inh):
            prep.warmed = inh  # adopted by the first boundary that fits
            prep.start(desc, None, speculative=True, then=lambda _a, cancel: inh.prefault(cancel))
        else:
            prep.start(desc, _warm_job(inh, prep.device), speculative=True)
        return
    nbytes, ntensors = estimate_state_bytes(snap.state)
    cap = slot_capacity(nbytes, snap.chunk_bytes)
    meta_cap = meta_capacity(estimate_meta_len(ntensors))
    total = native().Arena.required_bytes(snap.num_slots, cap, meta_cap, snap.chunk_bytes)
    if snap.num_slots * nbytes > prep.sync_max_bytes:
        _start_create(prep, snap, _what(snap, total), cap, meta_cap, prep.device,
                      speculative=True)


def _what(snap: Any, total: int) -> str:
    return f"the staging arena ({snap.num_slots} slots, {total / 2**30:.2f} GiB)"


def _not_ready(snap: Any, step: int) -> None:
    snap._stats.skipped_not_ready += 1
    snap._prep.note_skip(step)


def _adopt_prepared(snap: Any, got: Prepared) -> Any:
    if got.arena is snap._inherited:
        snap._inherited = None
    elif got.created is False and snap._inherited is not None:
        snap._inherited = None  # its private pinned replacement (register refused)
    snap._stats.arena_setup_seconds = got.seconds
    snap._arena = snap._adopt(got.arena)
    a = snap._arena
    log.info("staging arena %s: %d slots x %.1f MB, set up in %.2f s off the training thread",
             a.path, a.num_slots, a.data_capacity / 1e6, got.seconds)
    return a


def _settle(snap: Any) -> None:
    """``ensure(sync=True)`` while a set-up's job runs: a job at work is waited for (it
    is further along than a new start here would be); one not started yet (held) is
    cancelled, and the caller makes the arena itself."""
    prep: ArenaPreparer = snap._prep
    if prep.started:
        log.warning("cudasnap: waiting for %s (the synchronous snapshot needs it)", prep._what)
        if not prep.wait_handed(snap.wait_timeout_s):
            log.error("cudasnap: %s was not ready after %.0f s", prep._what, snap.wait_timeout_s)
        return
    prep.cancel(min(60.0, snap.wait_timeout_s))


def ensure(snap: Any, plan: Any, meta_len: int, step: int, sync: bool = False) -> Any:
    """The arena for a snapshot of ``plan``, or None (boundary skipped: not ready yet).

    Small arenas are made here, synchronously; large ones (and the pre-fault and
    registration of an inherited one) by the background preparer. ``sync`` (a flush,
    trigger or close() before the arena is ready: cudasnap.core.early): whatever the
    size, the arena is made or adopted here, now (a running set-up is waited for or
    cancelled first). Holds ``snap._arena_lock``: a boundary that finds it taken (a
    synchronous set-up on another thread) is skipped, never blocked.
    """
    if threading.current_thread() is snap._prep._thread:
        return None  # a regrowth's own flush (its live copy): never into the arena it replaces
    lock = snap._arena_lock
    if not lock.acquire(timeout=snap.wait_timeout_s if sync else 0):
        if sync:
            log.error("cudasnap: the staging arena stayed busy for %.0f s", snap.wait_timeout_s)
        else:
            _not_ready(snap, step)
        return None
    try:
        return _ensure(snap, plan, meta_len, step, sync)
    finally:
        lock.release()


def _ensure(snap: Any, plan: Any, meta_len: int, step: int, sync: bool) -> Any:
    prep: ArenaPreparer = snap._prep
    if prep.pending:
        if not sync:
            _not_ready(snap, step)
            return None
        _settle(snap)
        if prep.pending:
            return None
    got = prep.take()  # raises the background set-up's error (once)
    nbytes = plan.total_bytes
    a = snap._arena
    if a is not None and a.data_capacity >= nbytes and a.meta_capacity >= meta_len:
        drop(got.arena if got is not None and got.created else None)
        return a
    discard = None
    if got is not None and got.arena is not None:
        if a is None and _fits(got.arena, snap, nbytes, meta_len) and (
                snap._cuda is None or got.arena.cuda_registered):
            return _adopt_prepared(snap, got)
        if got.created:
            discard = got.arena  # too small or not page-locked: made again below
        elif got.arena is not snap._inherited:
            drop(got.arena)
    del got
    need_meta = meta_capacity(meta_len)
    inh = snap._inherited
    if a is None and inh is not None and _fits(inh, snap, nbytes, need_meta):
        if prep.warmed is inh or inh.num_slots * inh.data_capacity <= prep.sync_max_bytes \
                or sync:
            if prep.warmed is not inh and not (sync and fully_reserved(inh)):
                inh.prefault()  # (sync: only its holes are reserved and mapped)
            snap._inherited = None
            snap._arena = snap._adopt(inh)  # CUDA: page-locked here when not yet
            return snap._arena
        prep.start(f"the staging arena left by the previous process ({inh.path})",
                   _warm_job(inh, _device(snap)))
        _not_ready(snap, step)
        return None
    cap = slot_capacity(nbytes, snap.chunk_bytes)
    total = native().Arena.required_bytes(snap.num_slots, cap, need_meta, snap.chunk_bytes)
    regrow = a is not None
    del a, inh  # the old mapping must go before the new arena's free-space check
    if not sync and (snap.num_slots * nbytes > prep.sync_max_bytes or discard is not None):
        if regrow:
            log.warning("state grew to %d bytes; re-creating the staging arena in the "
                        "background", nbytes)
        _start_create(prep, snap, _what(snap, total), cap, need_meta, _device(snap),
                      retire=regrow, drop_inherited=snap._inherited is not None,
                      discard=discard)
        _not_ready(snap, step)
        return None
    drop(discard)
    # sync (large): reserved only, not pre-faulted (the copy maps the pages it writes)
    return snap._make_arena_here(regrow, cap, need_meta, prefault=not sync)


def _device(snap: Any) -> int | None:
    return snap._cuda.index if snap._cuda is not None else snap._prep.device


def shutdown(snap: Any, timeout: float) -> None:
    """close(): stops a running set-up (bounded) and removes an arena made but never
    adopted (it holds no snapshot)."""
    prep: ArenaPreparer = snap._prep
    if prep.busy:
        prep.cancel(timeout)
    try:
        got = prep.take()
    except Exception as e:  # cancelled (or failed): a cancelled create removes its file
        log.info("cudasnap: arena set-up stopped by close(): %s", e)
        got = None
    if got is not None and got.created and got.arena is not None and got.arena is not snap._arena:
        drop(got.arena)
