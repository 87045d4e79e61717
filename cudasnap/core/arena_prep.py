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
(``stats()["skipped_not_ready"]``) with one log line per set-up. Arenas whose
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

from .._native import native
from ..errors import SnapshotError, StagingError

log = logging.getLogger("cudasnap")

SYNC_MAX_BYTES = 16 << 20
MIN_META = 1 << 20
PAGE = 4096

# TEST-ONLY: when set, the preparer thread waits on this event before it starts
# any work (tests release it to prove boundaries never wait for the arena).
test_gate: threading.Event | None = None

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
    polls it (:attr:`busy`, :meth:`take`) and never waits for it."""

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
        self._logged = False
        self._what = ""
        self._speculative = False

    @property
    def busy(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def start(self, what: str, job: Callable[[Any], tuple[Any, str | None, bool]],
              speculative: bool = False) -> None:
        """Runs ``job(cancel_flag) -> (arena, fallback_reason, created)`` in the background.

        ``speculative`` (sized before the first boundary): a failure is logged, not
        raised; the first boundary then sizes the arena from its copy plan.
        """
        if self.busy:
            raise StagingError("an arena set-up is already running")
        self._speculative = speculative
        self._cancel = native().CancelFlag()
        self._result = self._error = None
        self._logged = False
        self._what = what
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, args=(job, self._cancel),
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

    def _run(self, job: Callable[[Any], tuple[Any, str | None, bool]], cancel: Any) -> None:
        try:  # like the copy workers: spare cycles only, never ahead of the training thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        try:
            gate = test_gate
            while gate is not None and not gate.wait(0.05):
                if cancel.is_set:
                    raise StagingError("arena set-up cancelled before it started")
            if self.device is not None:
                torch.cuda.set_device(self.device)  # registration and cudaHostAlloc target it
            t0 = time.perf_counter()
            arena, reason, created = job(cancel)
            if reason:
                self.fallback_reason = reason
            self._result = Prepared(arena, time.perf_counter() - t0, reason, created)
        except BaseException as e:  # handed to the training thread by take()
            self._error = e

    def note_skip(self, step: int) -> None:
        """Counts a boundary skipped for want of an arena; logs the first one only."""
        self.skipped += 1
        if not self._logged:
            self._logged = True
            log.warning("cudasnap: step %d not snapshotted: %s is being prepared in the "
                        "background; boundaries are skipped until it is ready (counted in "
                        "stats()['skipped_not_ready'])", step, self._what)

    def take(self) -> Prepared | None:
        """The finished set-up (once), or None. Raises the set-up's error (once)."""
        if self.busy:
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
        arena = snap._create_arena(capacity, meta_cap, cancel)
        try:
            got, reason = pin(arena, device)
        except BaseException:
            arena.unlink()
            raise
        return got, reason, True
    return job


def start_at_construction(snap: Any) -> None:
    """Starts preparing the arena now when it is too large to make at a boundary:
    the inherited one (pre-fault, register) or a new one sized from the state."""
    prep: ArenaPreparer = snap._prep
    inh = snap._inherited
    if inh is not None:
        if inh.num_slots * inh.data_capacity <= prep.sync_max_bytes:
            inh.prefault()  # small: as before, here (CUDA registration at adoption)
            prep.warmed = inh
        else:
            prep.start(f"the staging arena left by the previous process ({inh.path}, "
                       f"{inh.total_bytes / 2**30:.2f} GiB)", _warm_job(inh, prep.device),
                       speculative=True)
        return
    nbytes, ntensors = estimate_state_bytes(snap.state)
    cap = slot_capacity(nbytes, snap.chunk_bytes)
    meta_cap = meta_capacity(estimate_meta_len(ntensors))
    total = native().Arena.required_bytes(snap.num_slots, cap, meta_cap, snap.chunk_bytes)
    if snap.num_slots * nbytes > prep.sync_max_bytes:
        prep.start(_what(snap, total), _create_job(snap, cap, meta_cap, prep.device,
                                                    retire=False, drop_inherited=False,
                                                    discard=None), speculative=True)


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


def ensure(snap: Any, plan: Any, meta_len: int, step: int) -> Any:
    """The arena for a snapshot of ``plan``, or None (boundary skipped: not ready yet).

    Small arenas are made here, synchronously; large ones (and the pre-fault and
    registration of an inherited one) by the background preparer.
    """
    prep: ArenaPreparer = snap._prep
    if prep.busy:
        _not_ready(snap, step)
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
        if prep.warmed is inh or inh.num_slots * inh.data_capacity <= prep.sync_max_bytes:
            if prep.warmed is not inh:
                inh.prefault()
            snap._inherited = None
            snap._arena = snap._adopt(inh)
            return snap._arena
        prep.start(f"the staging arena left by the previous process ({inh.path})",
                   _warm_job(inh, _device(snap)))
        _not_ready(snap, step)
        return None
    cap = slot_capacity(nbytes, snap.chunk_bytes)
    total = native().Arena.required_bytes(snap.num_slots, cap, need_meta, snap.chunk_bytes)
    regrow = a is not None
    del a, inh  # the old mapping must go before the new arena's free-space check
    if snap.num_slots * nbytes > prep.sync_max_bytes or discard is not None:
        if regrow:
            log.warning("state grew to %d bytes; re-creating the staging arena in the "
                        "background", nbytes)
        prep.start(_what(snap, total), _create_job(
            snap, cap, need_meta, _device(snap), retire=regrow,
            drop_inherited=snap._inherited is not None, discard=discard))
        _not_ready(snap, step)
        return None
    return snap._make_arena_here(regrow, cap, need_meta)


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
    if got is not None and got.created and got.arena is not None:
        drop(got.arena)
