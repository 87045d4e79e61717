"""The background thread that sets up a staging arena, and the arena's pinning and removal.

Why off the training thread (issue 11 item 8, issue 15 target 1):
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
(:mod:`cudasnap.core.arena_keeper`: ``start_at_construction``, ``ensure``, ``shutdown``);
:mod:`cudasnap.core.arena_size` sizes the arena (``estimate_state_bytes``, slot and manifest
capacities; a synchronous set-up's limit is ``config.ARENA_SYNC_MAX_BYTES``).

Owns :class:`ArenaPreparer` (one set-up at a time on a daemon thread: its job makes the
arena usable, an optional follow-up pre-faults it at nice 10; :meth:`ArenaPreparer.paused`
holds it while a restore reads), :class:`Prepared` (what a finished set-up hands over),
:func:`pin` (page-locking for CUDA) and :func:`drop` (unregister and remove an arena no one
needs), and the stop of set-ups still running at interpreter exit. It knows nothing of the
Snapshotter: when it runs a job is the ``ArenaKeeper``'s; the jobs are at the end of this module
(``warm_job``, ``prefault_then``, ``fully_reserved``).

Call order: the Snapshotter's constructor makes one ``ArenaPreparer`` (``snap._prep``);
``ArenaKeeper.start_at_construction`` (the constructor) and ``ArenaKeeper.ensure`` (a boundary
whose plan no longer fits) call :meth:`~ArenaPreparer.start`; the training thread polls
:attr:`~ArenaPreparer.pending` at each boundary and collects the result with
:meth:`~ArenaPreparer.take` once it is done (``ArenaKeeper.ensure``); a boundary skipped
meanwhile calls :meth:`~ArenaPreparer.note_skip`; a restore (``cudasnap.core.restore``, from
disk or from an arena slot) runs inside :meth:`~ArenaPreparer.paused`; ``ArenaKeeper.shutdown``
(``close()``) calls :meth:`~ArenaPreparer.cancel`, then ``take``. Before its work the thread
reaches the test point ``arena_prep.hold`` (cudasnap._points; ``cudasnap._testing.arena_gate``
holds it there).
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
from typing import TYPE_CHECKING

import torch

from .. import _points
from .._native import native
from ..errors import SnapshotError, StagingError

if TYPE_CHECKING:
    from cudasnap._C import Arena, CancelFlag

# A set-up's job: (cancel flag) -> (arena or None, why it is process-private, a new file)
Job = Callable[["CancelFlag"], "tuple[Arena | None, str | None, bool]"]
# Its follow-up, once the arena was handed over: (arena, cancel flag)
Then = Callable[["Arena | None", "CancelFlag"], None]

log = logging.getLogger("cudasnap")


@dataclass
class Prepared:
    """What a finished set-up hands to the training thread."""

    arena: Arena | None  # None: nothing to adopt (the regrowth gave up; the next boundary retries)
    seconds: float
    fallback_reason: str | None  # why the arena is process-private (register refused)
    created: bool  # a new arena file (not the inherited one)


def pin(arena: Arena, device: int | None) -> tuple[Arena, str | None]:
    """Page-locks ``arena`` for ``device`` (None: CPU backend, nothing to do)."""
    if device is None:
        return arena, None
    from .._cuda import pin_arena

    return pin_arena(arena, device)


def drop(arena: Arena | None) -> None:
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
        self.warmed: Arena | None = None  # the inherited arena, once pre-faulted/registered
        self.skipped = 0
        self._thread: threading.Thread | None = None
        self._cancel: CancelFlag | None = None
        self._result: Prepared | None = None
        self._error: BaseException | None = None
        self._handed = threading.Event()  # the job's result is ready (a follow-up may run)
        self._started = False  # past the hold point: the job does real work
        self._logged = False
        self.what = ""  # the running set-up, in words (logs)
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

    def start(self, what: str, job: Job | None,
              speculative: bool = False,
              then: Then | None = None) -> None:
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
        self.what = what
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, args=(job, then, self._cancel),
                                        name="cudasnap-arena-prep", daemon=True)
        self._thread.start()
        _running.add(self)
        log.info("cudasnap: preparing %s in the background", what)

    def run_here(self, job: Job) -> Prepared:
        """The same job, synchronously (small arenas)."""
        t0 = time.perf_counter()
        arena, reason, created = job(native().CancelFlag())
        if reason:
            self.fallback_reason = reason
        return Prepared(arena, time.perf_counter() - t0, reason, created)

    @staticmethod
    def _hold(cancel: CancelFlag) -> None:
        """A point where a test can hold the set-up before its work starts
        (cudasnap._testing.arena_gate; a cancel meanwhile raises StagingError there)."""
        _points.reach("arena_prep.hold", cancel=cancel)

    @staticmethod
    def _nice(n: int) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), n)
        except OSError:
            pass

    def _run(self, job: Job | None, then: Then | None, cancel: CancelFlag) -> None:
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
                log.debug("cudasnap: pre-fault of %s stopped on request (%s)", self.what, e)
            else:
                log.warning("cudasnap: pre-faulting %s failed (%s); copies fault its pages in "
                            "themselves", self.what, e)

    def note_skip(self, step: int) -> None:
        """Counts a boundary skipped for want of an arena; logs the first one only."""
        self.skipped += 1
        if not self._logged:
            self._logged = True
            log.warning("cudasnap: step %d not snapshotted: %s is being prepared in the "
                        "background; boundaries are skipped until it is ready (counted in "
                        "stats()['skipped_not_ready']; a flush, close() or a trigger meanwhile "
                        "snapshots the live state synchronously)", step, self.what)

    def take(self) -> Prepared | None:
        """The finished set-up (once), or None. Raises the set-up's error (once)."""
        if self.pending:
            return None
        err, res = self._error, self._result
        self._error = self._result = None
        if err is not None and self._cancel is not None and self._cancel.is_set:
            log.debug("cudasnap: preparing %s stopped on request (%s)", self.what, err)
            return None  # cancelled by close() or a newer set-up: not a failure
        if err is not None and self._speculative:
            log.warning("cudasnap: preparing %s failed (%s); the first boundary sizes the "
                        "arena from its copy plan instead", self.what, err)
            return None
        if err is not None:
            raise err
        if res is not None and self.skipped:
            log.info("cudasnap: %s ready after %.2f s; %d boundaries were skipped meanwhile",
                     self.what, res.seconds, self.skipped)
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
