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
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import _points
from .._native import native
from ..errors import SnapshotError, StagingError

log = logging.getLogger("cudasnap")

SYNC_MAX_BYTES = 16 << 20
MIN_META = 1 << 20
PAGE = 4096

# Per-parameter state tensors that known optimizers create at their first step:
# (full-size slots, scalar tensor slots) given the parameter group.
_Slots = Callable[[dict[str, Any]], tuple[int, int]]
_OPT_SLOTS: dict[str, _Slots] = {
    "Adam": lambda g: (2 + bool(g.get("amsgrad")), 1),
    "AdamW": lambda g: (2 + bool(g.get("amsgrad")), 1),
    "Adamax": lambda g: (2, 1),
    "NAdam": lambda g: (2, 2),
    "RAdam": lambda g: (2, 1),
    "Adadelta": lambda g: (2, 1),
    "Rprop": lambda g: (2, 1),
    "ASGD": lambda g: (1, 3),
    "RMSprop": lambda g: (1 + bool(g.get("momentum")) + bool(g.get("centered")), 1),
    "SGD": lambda g: (1 if g.get("momentum") else 0, 0),
    "Adagrad": lambda g: (1, 1),
}


def _span(nbytes: int, host: bool) -> int:
    """Upper bound of the bytes one tensor takes in a slot (the copy plan aligns each
    range to 4 KiB, may start it up to 15 bytes early, and joins host spans across
    gaps of up to 4 KiB)."""
    n = (nbytes + 15 + PAGE - 1) // PAGE * PAGE
    return n + (PAGE if host else 0)


def _opt_slots(opt: torch.optim.Optimizer) -> _Slots | None:
    for cls in type(opt).__mro__:  # subclasses of a known optimizer keep its state
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _OPT_SLOTS:
            return _OPT_SLOTS[cls.__name__]
    return None


def estimate_state_bytes(state: Any) -> tuple[int, int]:
    """(slot bytes, tensor count) the state will need once every optimizer has stepped.

    Tensors that exist are counted as they are; parameters without optimizer
    state yet get the state slots their optimizer class creates (known
    ``torch.optim`` classes; others: none, so a first boundary that needs more
    regrows the arena in the background).
    """
    seen: set[int] = set()
    total = PAGE  # the phase-0 / phase-1 boundary is page aligned
    count = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total, count
        if id(t) in seen:
            return
        seen.add(id(t))
        total += _span(t.numel() * t.element_size(), not t.is_cuda)
        count += 1

    for mod in state.models.values():
        for t in mod.state_dict(keep_vars=True).values():
            if isinstance(t, torch.Tensor):
                add(t)
    for opt in state.optimizers.values():
        slots = _opt_slots(opt)
        for g in opt.param_groups:
            for p in g["params"]:
                st = opt.state.get(p)
                if st:
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            add(v)
                elif slots is not None:
                    full, scalars = slots(g)
                    total += full * _span(p.numel() * p.element_size(), not p.is_cuda)
                    total += scalars * _span(4, True)
                    count += full + scalars
    return total, count


def slot_capacity(nbytes: int, chunk_bytes: int) -> int:
    """Data bytes per slot for a plan of ``nbytes``: headroom for small growth."""
    cap = nbytes + nbytes // 64 + chunk_bytes
    return (cap + PAGE - 1) // PAGE * PAGE


def meta_capacity(meta_len: int) -> int:
    return (max(MIN_META, 4 * meta_len) + PAGE - 1) // PAGE * PAGE


def estimate_meta_len(ntensors: int) -> int:
    """Manifest bytes: ~200 B per tensor entry plus the host state (RNG states, ...)."""
    return 256 * ntensors + (64 << 10)


@dataclass
class Prepared:
    """What a finished set-up hands to the training thread."""

    arena: Any  # None: nothing to adopt (the regrowth gave up; the next boundary retries)
    seconds: float
    fallback_reason: str | None  # why the arena is process-private (register refused)
    created: bool  # a new arena file (not the inherited one)


def pin(arena: Any, device: int | None) -> tuple[Any, str | None]:
    """Page-locks ``arena`` for ``device`` (None: CPU backend, nothing to do)."""
    if device is None:
        return arena, None
    from .._cuda import pin_arena

    return pin_arena(arena, device)


def drop(arena: Any) -> None:
    """Unregisters (CUDA) and removes an arena that holds no snapshot anyone needs."""
    if arena is None:
        return
    if arena.cuda_registered and arena.shared:
        try:
            native().unregister_arena(arena)
        except SnapshotError as e:
            log.warning("cudasnap: cudaHostUnregister of %s failed: %s", arena.path, e)
    if arena.shared:
        arena.unlink()


# Set-ups still running at interpreter exit are stopped first: a daemon thread inside the
# native pre-fault (GIL released) that wakes up during finalization is unwound by
# pthread_exit through C++ frames, which aborts the process ("terminate called without
# an active exception", exit 134) in a script that simply ends without close().
_running: weakref.WeakSet[ArenaPreparer] = weakref.WeakSet()


@atexit.register
def _stop_at_exit(timeout: float = 30.0) -> None:
    for prep in list(_running):
        if prep.busy:
            prep.cancel(timeout)


class ArenaPreparer:
    """Runs one arena set-up at a time on a daemon thread; the training thread
    polls it (:attr:`pending`, :meth:`take`) and never waits for it.

    A set-up has up to two parts: the job, which makes the arena usable (reserve its
    pages; on CUDA also page-lock it), and an optional follow-up run after the job's
    arena was handed over (:meth:`take` returns it at once): the pre-fault of an arena
    that snapshots may already use (content-safe: ``MADV_POPULATE_WRITE`` or reads).
    The job runs at the training thread's priority (until it is done the process is
    unprotected: issue 23 item 2), the follow-up at nice 10 (spare cycles only).
    """

    def __init__(self, sync_max_bytes: int, device: int | None) -> None:
        self.sync_max_bytes = int(sync_max_bytes)
        self.device = device
        self.fallback_reason: str | None = None
        self.warmed: Any = None  # the inherited arena, once pre-faulted/registered
        self.skipped = 0
        self._thread: threading.Thread | None = None
        self._cancel: Any = None
        self._result: Prepared | None = None
        self._error: BaseException | None = None
        self._handed = threading.Event()  # the job's result is ready (a follow-up may run)
        self._started = False  # past the hold point: the job does real work
        self._logged = False
        self._what = ""
        self._speculative = False

    @property
    def busy(self) -> bool:
        """A set-up (job or follow-up) still runs."""
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def pending(self) -> bool:
        """The running set-up's arena is not usable yet (its job still runs)."""
        return self.busy and not self._handed.is_set()

    @property
    def started(self) -> bool:
        """The running job began its work (it is not held before it)."""
        return self._started

    def start(self, what: str, job: Callable[[Any], tuple[Any, str | None, bool]] | None,
              speculative: bool = False,
              then: Callable[[Any, Any], None] | None = None) -> None:
        """Runs ``job(cancel_flag) -> (arena, fallback_reason, created)`` in the background,
        then ``then(arena, cancel_flag)`` once the arena was handed over (``job`` None:
        nothing to hand over, only ``then(None, cancel_flag)``).

        ``speculative`` (sized before the first boundary): a failure is logged, not
        raised; the first boundary then sizes the arena from its copy plan. A
        follow-up still running is stopped first (it is only a pre-fault).
        """
        if self.busy:
            if not self._handed.is_set():
                raise StagingError("an arena set-up is already running")
            self.cancel(60.0)  # a follow-up: stops within one 4 MiB piece
        self._speculative = speculative
        self._cancel = native().CancelFlag()
        self._result = self._error = None
        self._handed.clear()
        if job is None:
            self._handed.set()  # nothing to wait for: the arena is usable already
        self._started = False
        self._logged = False
        self._what = what
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, args=(job, then, self._cancel),
                                        name="cudasnap-arena-prep", daemon=True)
        self._thread.start()
        _running.add(self)
        log.info("cudasnap: preparing %s in the background", what)

    def run_here(self, job: Callable[[Any], tuple[Any, str | None, bool]]) -> Prepared:
        """The same job, synchronously (small arenas)."""
        t0 = time.perf_counter()
        arena, reason, created = job(native().CancelFlag())
        if reason:
            self.fallback_reason = reason
        return Prepared(arena, time.perf_counter() - t0, reason, created)

    @staticmethod
    def _hold(cancel: Any) -> None:
        """A point where a test can hold the set-up before its work starts
        (cudasnap._testing.arena_gate; a cancel meanwhile raises StagingError there)."""
        _points.reach("arena_prep.hold", cancel=cancel)

    @staticmethod
    def _nice(n: int) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), n)
        except OSError:
            pass

    def _run(self, job: Callable[[Any], tuple[Any, str | None, bool]] | None,
             then: Callable[[Any, Any], None] | None, cancel: Any) -> None:
        arena = None
        try:
            if job is not None:
                self._hold(cancel)
                self._started = True
                if self.device is not None:
                    torch.cuda.set_device(self.device)  # registration and cudaHostAlloc
                t0 = time.perf_counter()
                arena, reason, created = job(cancel)
                if reason:
                    self.fallback_reason = reason
                self._result = Prepared(arena, time.perf_counter() - t0, reason, created)
        except BaseException as e:  # handed to the training thread by take()
            self._error = e
            return
        finally:
            self._handed.set()
        if then is None:
            return
        # The follow-up: like the copy workers, spare cycles only.
        self._nice(10)
        try:
            self._hold(cancel)
            self._started = True
            then(arena, cancel)
        except BaseException as e:  # a pre-fault: the arena works without it
            if cancel.is_set:
                log.debug("cudasnap: pre-fault of %s stopped on request (%s)", self._what, e)
            else:
                log.warning("cudasnap: pre-faulting %s failed (%s); copies fault its pages in "
                            "themselves", self._what, e)

    def note_skip(self, step: int) -> None:
        """Counts a boundary skipped for want of an arena; logs the first one only."""
        self.skipped += 1
        if not self._logged:
            self._logged = True
            log.warning("cudasnap: step %d not snapshotted: %s is being prepared in the "
                        "background; boundaries are skipped until it is ready (counted in "
                        "stats()['skipped_not_ready']; a flush, close() or a trigger meanwhile "
                        "snapshots the live state synchronously)", step, self._what)

    def take(self) -> Prepared | None:
        """The finished set-up (once), or None. Raises the set-up's error (once)."""
        if self.pending:
            return None
        err, res = self._error, self._result
        self._error = self._result = None
        if err is not None and self._cancel is not None and self._cancel.is_set:
            log.debug("cudasnap: preparing %s stopped on request (%s)", self._what, err)
            return None  # cancelled by close() or a newer set-up: not a failure
        if err is not None and self._speculative:
            log.warning("cudasnap: preparing %s failed (%s); the first boundary sizes the "
                        "arena from its copy plan instead", self._what, err)
            return None
        if err is not None:
            raise err
        if res is not None and self.skipped:
            log.info("cudasnap: %s ready after %.2f s; %d boundaries were skipped meanwhile",
                     self._what, res.seconds, self.skipped)
        return res

    @contextlib.contextmanager
    def paused(self) -> Iterator[bool]:
        """Holds a running set-up at its next piece of work (4 MiB of pre-fault, 64 MiB
        of reservation) for the ``with`` block; yields whether one was running.

        A restore reading an arena slot wants both cores and the mmap lock the
        pre-fault takes; the set-up goes on where it stopped afterwards, so the
        arena still ends up fully prepared. ``cancel()`` ends a pause at once.
        """
        flag = self._cancel if self.busy else None
        if flag is None:
            yield False
            return
        flag.pause()
        try:
            yield True
        finally:
            flag.resume()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until no set-up runs (True) or ``timeout`` passes."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self.busy

    def wait_handed(self, timeout: float | None = None) -> bool:
        """Blocks until the running job's arena is usable (True) or ``timeout`` passes."""
        return not self.busy or self._handed.wait(timeout)

    def cancel(self, timeout: float) -> bool:
        """Asks the running set-up to stop (it stops within one 64 MiB piece of work;
        a regrowth's flush to disk runs to its end) and waits up to ``timeout`` s."""
        if self._cancel is not None:
            self._cancel.set()
        ok = self.wait(timeout)
        if not ok:
            log.error("cudasnap: the background arena set-up did not stop within %.0f s",
                      timeout)
        return ok


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
    snap._stats["skipped_not_ready"] += 1
    snap._prep.note_skip(step)


def _adopt_prepared(snap: Any, got: Prepared) -> Any:
    if got.arena is snap._inherited:
        snap._inherited = None
    elif got.created is False and snap._inherited is not None:
        snap._inherited = None  # its private pinned replacement (register refused)
    snap._stats["arena_setup_seconds"] = got.seconds
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
