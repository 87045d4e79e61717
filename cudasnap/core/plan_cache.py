"""Layouts: the copy plan cache, and how long each plan's tensors are held.

A ``Layout`` (``cudasnap.core.copy_plan``) is built at the first boundary and reused
while the optimizer state's key counts hold and ``cudasnap.core.layout_watch`` (a window
of identity checks per boundary, plus a periodic full re-scan) sees no replaced
tensor.

Storage lifetime: the copy reads the planned tensors' memory by address, so the
running copy's ``Layout`` (it holds every planned storage) is kept until the copy can
no longer read it: until the job is COMPLETE, and for a failed or cancelled job until
the engine has drained (``hold_draining``). Only then may ``p.data = ...``, ``set_()``
or a swapped optimizer state free a block it read.

Off the training thread (issue 26): a new plan for a state of ``OFF_THREAD_MIN_TENSORS``
tensors or more is built on a background thread (``_Build``); the boundary that asked
is skipped, its live state kept by the copier for a flush, ``wait()`` or ``close()``;
a later boundary adopts the plan after a full native check that the state did not
change under the build (else it builds again, on the training thread).

Call order: the ``Copier`` calls :meth:`Layouts.for_boundary` at each boundary it copies
(:meth:`Layouts.current` for the JIT live copy, the early saver, ``coverage()``); when
it returned None (a build started) :meth:`Layouts.start_build` as the boundary's last act;
then :meth:`Layouts.running_job` once the engine accepted the job; :meth:`Layouts.job_done`
when it retired that job, :meth:`Layouts.hold_draining` for a refused one on a hung GPU;
``close()`` calls :meth:`Layouts.join_build` before the engine stops and
:meth:`Layouts.release_at_close` after. The fences (optimizer load hooks), a restore and
``Snapshotter.invalidate_layout`` call :meth:`Layouts.invalidate`.
"""
from __future__ import annotations

import atexit
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, SnapshotError
from ..format import manifest as fmt
from ..format.manifest import tensor_entry, validate_tensors
from ..format.slot_manifest import encode_prefix
from . import layout_watch
from .copy_plan import Layout, make_plan
from .layout_watch import Watch, identity_entries
from .live_tensor import single_cuda_device

if TYPE_CHECKING:
    from .backend import Backend
    from .counters import Counters
    from .state import TrainingState

log = logging.getLogger("cudasnap")

# Layouts of copies a closed Snapshotter left running on a hung GPU: the DMA may
# still read their storages, so they are never freed (process lifetime, logged).
_ABANDONED: list[Layout] = []

# Builds whose thread may be running at interpreter exit (a script ending without close()
# right after a deferring boundary) are waited for first: a daemon thread coming back from
# a native call (GIL released) during finalization is unwound by pthread_exit through C++
# frames, which aborts the process ("terminate called without an active exception"), as
# for the arena set-up (core.arena_preparer._stop_at_exit).
_BUILDS: weakref.WeakSet[_Build] = weakref.WeakSet()


@atexit.register
def _join_at_exit(timeout: float = 30.0) -> None:
    for b in list(_BUILDS):
        b.stop(timeout)


class Layouts:
    RESCAN_EVERY = 64
    # A state of at least this many tensors has its plan built off the training thread
    # (issue 26): ~10 us of Python per tensor, 38 ms at 4,000 and ~0.5 s at 40,000 tensors
    # on the training thread otherwise. 1,000 tensors take ~5-10 ms here.
    OFF_THREAD_MIN_TENSORS = 1000

    def __init__(self, state: TrainingState, backend: Backend, counters: Counters, *,
                 chunk: Callable[[int], int], rank: int, world_size: int, job: str) -> None:
        self.state, self._backend, self._counters = state, backend, counters
        self.chunk, self.rank, self.world_size, self.job = chunk, rank, world_size, job
        self.rescan_every = self.RESCAN_EVERY
        self.layout: Layout | None = None  # the current plan (None: rebuilt at the next use)
        self.running: Layout | None = None  # the running copy's: it holds the planned storages
        self.draining: tuple[Layout, ...] = ()  # failed copies' until the engine drained them
        self.building: _Build | None = None  # a plan being built off the training thread
        self.spare: _Build | None = None  # a build thread started ahead, waiting (prestart)
        self.dropped: list[_Build] = []  # dropped builds that may still run (joined at close)

    def invalidate(self) -> None:
        """The copy plan is rebuilt at the next boundary (see Snapshotter.invalidate_layout);
        the running copy keeps reading the old tensors, which stay alive until it completes.
        A build running off the training thread is dropped (it may predate the change)."""
        self.layout = None
        b, self.building = self.building, None
        if b is not None:
            b.drop()
            self.dropped = [d for d in self.dropped if d.thread.is_alive()] + [b]

    def coverage(self) -> dict[str, object]:
        """Live device bytes vs bytes covered by the registered state (CUDA backend)."""
        cuda = self._backend.cuda
        if cuda is None:
            raise SnapshotError("coverage() needs the CUDA backend (state on a GPU)")
        lay = self.current()
        cov: dict[str, object] = self._backend.cuda.coverage(lay.tensors)
        return cov

    def info(self) -> dict[str, object] | None:
        """``stats()["layout"]``: the current plan's tensors and copy ranges (None: no plan)."""
        lay = self.layout
        if lay is None:
            return None
        cuda = self._backend.cuda
        return {"tensors": len(lay.tensors), "copy_ranges": int(lay.plan.num_ranges),
                "allocator_tracking": cuda is not None and cuda.registry is not None}

    def _build_layout(self) -> Layout:
        """A new Layout of the live state, with Python's cyclic GC held off meanwhile.

        The build makes ~10 container objects per tensor (LiveTensor, manifest entry,
        identity entry, ...) that live through several young collections: at 4,000
        tensors they are what makes the allocator count reach a full (generation 2)
        collection of the whole process, 80-280 ms of the first boundary measured here
        (issue 26), on the training thread. Held off, the collection runs where the
        program next allocates enough, not inside the boundary: it is not this build's
        work (everything the process made since the last one is walked). Re-enabled
        only when it was enabled."""
        if not gc.isenabled():
            return self._build_layout_now()
        gc.disable()
        try:
            return self._build_layout_now()
        finally:
            gc.enable()

    def _build_layout_now(self) -> Layout:
        tensors = self.state.live_tensors()
        be = self._backend
        if be.requested == "cpu":  # its copy workers read host memory only
            on_gpu = next((lt.name for lt in tensors if lt.tensor.is_cuda), None)
            if on_gpu is not None:
                raise ConfigError(f"backend='cpu' but {on_gpu} lives on a CUDA device: move "
                                  "it to the CPU, or use backend='cuda' (or 'auto')")
        be.ensure(tensors)  # the copy engine: made by the first build (CUDA: its plan needs it)
        if be.cuda is not None:
            single_cuda_device(tensors, be.cuda.index)
        plan, offsets = make_plan(tensors, be.cuda, self.chunk)
        entries = []
        for lt, off in zip(tensors, offsets):
            e = tensor_entry(lt.name, lt.group, lt.tensor, off, lt.phase, lt.nbytes)
            if lt.param_index is not None:
                e["param_index"], e["state_key"] = lt.param_index, lt.state_key
            if lt.aliases:
                e["aliases"] = lt.aliases
            if lt.shard is not None:  # a DTensor's local shard (cudasnap.core.sharded)
                e["shard"] = lt.shard
            if lt.wrapper is not None:  # a subclass's inner tensor (cudasnap.core.wrapped)
                e["wrapper"] = lt.wrapper.record
            entries.append(e)
        validate_tensors(entries, plan.total_bytes, "layout")
        head = fmt.head(rank=self.rank, world_size=self.world_size, job=self.job,
                        backend=be.name, torch=torch.__version__,
                        dcp_names=self.state.dcp_names())
        prefix = encode_prefix(head, entries)  # the slot manifest up to its host value
        self._counters.layout_rebuilds += 1
        log.debug("layout: %d tensors, %d copy ranges, %.1f MB", len(tensors), plan.num_ranges,
                  plan.total_bytes / 1e6)
        return Layout(tensors, plan, prefix, Watch(identity_entries(self.state, tensors)),
                      self.rescan_every, list(self.state.optimizers.values()))

    def current(self) -> Layout:
        """The plan of the live state now: the cached one while the state holds, else a
        new one (a build running off the training thread is waited for and adopted)."""
        lay = self._plan(defer=False)
        assert lay is not None  # only a deferred call returns None
        return lay

    def for_boundary(self) -> Layout | None:
        """The copier's at a boundary: like :meth:`current`, but None while a large
        state's new plan is built off the training thread (the boundary is skipped)."""
        return self._plan(defer=True)

    def _plan(self, defer: bool) -> Layout | None:
        """The cached plan while the state holds, else a new one.

        ``defer`` (``for_boundary``): a new plan for a state of
        ``OFF_THREAD_MIN_TENSORS`` tensors or more is built on a background thread and
        None returned (the boundary is skipped; the copier keeps its live state for a
        flush or ``wait()``); a later call adopts the finished build once a full native
        check of it (every identity entry and data pointer, the optimizer signature)
        found the state unchanged. Without ``defer`` (a flush's live copy, coverage())
        a running build is waited for, or the plan built here."""
        lay = self.layout
        if lay is not None:
            # One native call, O(WINDOW) whatever the tensor count: the signature
            # (len(opt.state) per optimizer), WINDOW identity entries and WINDOW data
            # pointers (cudasnap.core.layout_watch); 2: fresh, but the periodic full
            # re-scan is due.
            fresh = lay.guard.boundary_check(layout_watch.WINDOW)
            if fresh != 1:  # the re-scan (due: 2) runs a bounded piece per boundary
                if lay.rescan(self.state.identity_pieces(lay.tied) if fresh == 2 else None
                              ) is not False:
                    return lay
            self.layout = None
        b = self.building
        if b is not None:
            if defer and b.thread.is_alive():
                return None
            b.go.set()  # a build not let go yet (start_build) runs now
            b.thread.join()
            self.building = None
            built = b.adopt()
            if built is not None:
                self.layout = built
                return built
        elif defer and self._large(lay):
            self.building, self.spare = self.spare or _Build(self), None
            return None
        self.layout = self._build_layout()
        return self.layout

    def prestart(self) -> None:
        """Construction: when the state will be large once the optimizers stepped, the
        first build's thread is started now, parked until that boundary asks for it
        (``Thread.start`` at the boundary waits for the new thread to be scheduled: up
        to several ms on a busy machine, while an arena set-up runs beside it).
        Expected count: the model's tensors, the optimizers' state entries, and two per
        parameter of an optimizer without state yet (Adam's moments)."""
        n = self._count_state()
        for opt in self.state.optimizers.values():
            if not opt.state:
                n += 2 * sum(len(g["params"]) for g in opt.param_groups)
        if n < self.OFF_THREAD_MIN_TENSORS or self.spare is not None:
            return
        try:
            self.spare = _Build(self)
        except RuntimeError as e:  # no thread to spare ("can't start new thread"): the
            log.debug("layout: no build thread started ahead (%s)", e)  # boundary starts it
            return
        # The parked thread holds the Layouts only weakly, and ends when they are collected.
        weakref.finalize(self, self.spare.drop)

    def _count_state(self) -> int:
        """Tensors of the state, counted without walking them: the modules' parameters
        and buffers, the optimizers' state entries."""
        n = 0
        for mod in self.state.models.values():
            for m in mod.modules():
                n += len(m._parameters) + len(m._buffers)
        for opt in self.state.optimizers.values():
            n += sum(len(s) for s in opt.state.values())
        return n

    def _large(self, old: Layout | None) -> bool:
        """Whether a new plan of the state is built off the training thread: the old
        plan's tensor count, or, for the first plan, the state's (a count, no walk of
        the tensors: modules' parameters and buffers, the optimizers' state entries)."""
        if old is not None:
            return len(old.tensors) >= self.OFF_THREAD_MIN_TENSORS
        return self._count_state() >= self.OFF_THREAD_MIN_TENSORS

    # ------------------------------------------------- how long plans are held
    def running_job(self, lay: Layout) -> None:
        """The engine accepted a copy of ``lay``: hold it until the job is COMPLETE (one
        reference, O(1)); the copies of the held failed layouts are over
        (``release_drained``)."""
        self.running = lay
        if self.draining:
            self.release_drained()

    def job_done(self, failed: bool) -> None:
        """The copier retired the running job (COMPLETE, or ``failed``)."""
        # (No local holds the layout: a logged error's traceback keeps this frame.)
        if failed:
            self.hold_draining(self.running)
        else:
            # COMPLETE: its copy has drained, and so has every earlier one (one
            # copy at a time; on CUDA in stream order): their layouts may go.
            self.draining = ()
        self.running = None

    def hold_draining(self, lay: Layout | None) -> None:
        """Keeps the layout of a failed or cancelled copy (and so its storages) alive.

        A job fails as soon as it is cancelled (a fence's bounded wait ran out) or
        its completion wait timed out, while its copy may still be reading: CPU
        workers finish the chunk they are in, and a DMA already queued on the copy
        stream runs whenever the GPU gets to it. The layout is released when the
        engine is known to have drained it: the next accepted submit (see
        ``release_drained``), the next COMPLETE job, or ``close()``.
        """
        if lay is not None and all(lay is not h for h in self.draining):
            self.draining = (*self.draining, lay)

    def release_drained(self) -> None:
        """After the engine accepted a new job: the copies of the held layouts are over.

        The CPU engine accepts a job only once the previous one's workers finished;
        the CUDA engine only once its completion thread finished the previous job,
        which waits for that job's last DMA unless the GPU was declared hung (then
        the layouts stay until a later job completes, which is after them in stream
        order, or are abandoned at close)."""
        if self.draining and not self._backend.hung():
            self.draining = ()

    def join_build(self, timeout: float) -> None:
        """``close()``, before the engine stops: a plan still being built (it may be
        making the engine) is waited for, bounded, and dropped."""
        # The spare was never asked for (it ends at once); a dropped one was invalidated
        # while building (it may still be making the engine).
        builds = [b for b in (self.spare, self.building, *self.dropped) if b is not None]
        self.spare, self.building, self.dropped = None, None, []
        for b in builds:
            b.stop(timeout)

    def start_build(self) -> None:
        """The boundary that started a build off the training thread is done: the build
        runs from now (until then its thread waits, so the rest of that boundary never
        waits a GIL switch interval, 5 ms, behind it)."""
        b = self.building
        if b is not None:
            b.go.set()

    def release_at_close(self, drained: bool) -> None:
        """close(): the engine is stopped; ``drained``: no copy can still read the state."""
        held = [lay for lay in (*self.draining, self.running) if lay is not None]
        self.draining = ()
        self.running = None
        if held and not drained:
            _ABANDONED.extend(held)
            log.error("close(): a snapshot copy may still be reading the state (GPU hung); "
                      "its %d tensor(s) are kept allocated for the life of the process",
                      sum(len(lay.tensors) for lay in held))


class _Build:
    """One plan built on a background thread (``Layouts.current(defer=True)``).

    The thread runs the same build as the training thread would (GC held off, see
    ``Layouts._build_layout``), the first one making the copy engine (``Backend.ensure``;
    the CUDA plan needs the allocator registry); the training thread adopts the result
    (``adopt``) at a later boundary, or waits for it (a flush, ``wait()``, ``close()``):
    no other user of the engine runs meanwhile (no copy job exists before the first plan). A build that
    failed (an error naming a tensor, a container changed under the walk) is not
    reported from here: the adopting call builds again on the training thread, which
    raises the error there or succeeds."""

    def __init__(self, layouts: Layouts) -> None:
        self.layout: Layout | None = None
        self.error: BaseException | None = None
        self.go = threading.Event()  # set by Layouts.start_build (or a wait for the build)
        self.dropped = False
        self.thread = threading.Thread(target=self._run, args=(weakref.ref(layouts),),
                                       daemon=True, name="cudasnap-layout")
        self.thread.start()
        _BUILDS.add(self)

    def drop(self) -> None:
        """The build is not wanted (invalidate, close): a thread still waiting for ``go``
        ends without building; one already building finishes and is not adopted."""
        self.dropped = True
        self.go.set()

    def stop(self, timeout: float) -> None:
        """``drop``, then waits (bounded) for the thread: a parked one ends at once, a
        running one finishes its build."""
        self.drop()
        self.thread.join(timeout)

    def _run(self, ref: weakref.ref[Layouts]) -> None:
        # Waits (the GIL released) until the boundary that started it is done; holds the
        # Layouts (and so the state) only weakly meanwhile.
        self.go.wait()
        layouts = ref()
        if self.dropped or layouts is None:
            return
        try:
            self.layout = layouts._build_layout()
        except BaseException as e:  # noqa: BLE001 - re-raised by the build on the training thread
            self.error = e

    def adopt(self) -> Layout | None:
        """Training thread, the build finished: its plan when it still describes the live
        state (None: build again here)."""
        lay = self.layout
        if lay is None:
            log.debug("layout: the background build failed (%r); building on this thread",
                      self.error)
            return None
        if lay.guard.boundary_check(1 << 62) == 1:  # every entry and pointer, natively
            log.debug("layout: the state changed during the background build; building again")
            return None
        return lay
