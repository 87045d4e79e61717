"""The Copier: a boundary's host state and cached copy plan handed to the engine, and the job's fences.

``Snapshotter.boundary()`` checks the step rule (``Timeline``), then calls
:meth:`Copier.snapshot`, which encodes the host state, picks a free slot of the
arena and submits the copy; it returns at once. Zero-overhead mode
(``snapshot_every=k``, or the overhead budget's k: ``cudasnap.core.cadence``) copies
every k-th boundary and remembers the others
(``live``) for a just-in-time copy at a flush (:meth:`Copier.copy_live`).

Shaped like DCP's ``AsyncStager``: ``snapshot()`` is its ``stage()`` (starts the copy,
returns at once), :meth:`Copier.fence` / :meth:`Copier.wait_job` are its
``synchronize_staging()`` (the fences in ``cudasnap.core.fences`` call ``fence`` before a
write of the state; a flush, a restore and ``close()`` call ``wait_job``).

Call order (one copy at a time, under ``slot_lock`` only to pick a slot and to swap
the job): ``snapshot`` -> ``Layouts.current`` -> ``ArenaKeeper.ensure`` (skipped while
the arena it returned for this plan still fits) -> ``arena.pick_write_slot`` ->
``engine.submit`` -> ``Layouts.running_job``; then, on the training thread, the fences
(``fence(0)``: a buffer's module forward; ``fence(1)``: the optimizer step) or a
``wait_job``, which retires the job (``Layouts.job_done``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import SnapshotError, StagingError
from ..format.slot_manifest import suffix_pieces
from .copy_plan import Layout
from .host_capture import HostText
from .pending_boundary import PendingBoundary
from .rng import capture_rng

if TYPE_CHECKING:
    import torch

    from cudasnap._C import CopyJob

    from .arena_keeper import ArenaKeeper
    from .backend import Backend
    from .cadence import Cadence
    from .counters import Counters
    from .plan_cache import Layouts
    from .state import TrainingState

log = logging.getLogger("cudasnap")


class Copier:
    def __init__(self, state: TrainingState, backend: Backend, layouts: Layouts,
                 keeper: ArenaKeeper, counters: Counters, *, wait_timeout_s: float,
                 cadence: Cadence) -> None:
        self.state, self._backend, self._layouts, self._keeper = state, backend, layouts, keeper
        self._counters = counters
        self.wait_timeout_s, self.cadence = wait_timeout_s, cadence
        self.job: CopyJob | None = None  # the running copy
        self.fenced = [True, True]  # per phase: the training thread waited for it already
        # Re-entrant: a signal handler may flush while the main thread is in boundary().
        self.slot_lock = threading.RLock()
        # The newest boundary not copied while the live tensors still hold it (the cadence
        # skipped it, its plan was being built, no arena was ready): cudasnap.core.pending_boundary.
        self.live = PendingBoundary()
        self._host_text: HostText | None = None  # made at the first boundary
        self._writers: list[torch.cuda.Stream] = []  # CUDA streams besides the current one that write state

    def add_writer(self, stream: object) -> None:
        """``stream`` (a ``torch.cuda.Stream``) writes the state besides the current
        stream: each copy also waits for its queued work, each fence also holds it."""
        import torch

        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"writer streams are torch.cuda.Stream objects, got {type(stream)!r}")
        if self._backend.cuda is not None:
            self._backend.cuda.check_writer(stream)
        if all(s.cuda_stream != stream.cuda_stream for s in self._writers):
            self._writers.append(stream)

    # --------------------------------------------------------------- stage()
    def snapshot(self, step: int, t0: int, boundaries: int, values: dict[str, object]) -> None:
        """The copy of ``step`` (the ``boundaries``-th boundary of this process) with its
        ``values``, or its skip; ``t0``: when boundary() started (perf_counter_ns)."""
        self.live.boundary_starts()  # dirty again at the next optimizer step / buffer forward
        self.state.step_values = values
        before = self._counters.snapshots
        try:
            self._snapshot(step, t0, values)
        finally:  # a boundary chosen to copy that was not copied counts as a plain step
            self.cadence.copied(self._counters.snapshots > before)

    def _snapshot(self, step: int, t0: int, values: dict[str, object]) -> None:
        if not self.cadence.take():
            # Zero-overhead mode: no copy. Until the next optimizer step the live
            # state IS this step, so a JIT flush copies it then (see flush()).
            self._counters.skipped_every += 1
            self.live.record(step, b"".join(self.host_suffix(step)))
            self._counters.record_boundary(t0)
            return
        self.live.clear()
        # A previous copy still running (no optimizer step in between): bounded.
        if self.job is not None and not self.wait_job(self.wait_timeout_s):
            self._counters.skipped += 1
            log.warning("step %d not snapshotted: the previous copy is still running after "
                        "%.0f s", step, self.wait_timeout_s)
            return
        lay = self._layouts.for_boundary()
        if lay is None:
            # A large state's plan is being built off the training thread (Layouts):
            # until the next optimizer step the live state IS this step, which a flush,
            # trigger, wait() or close() meanwhile copies (copy_live).
            try:
                self._counters.skipped_layout += 1
                self.live.record(step, b"".join(self.host_suffix(step)), deferred=True)
                self._counters.record_boundary(t0)
            finally:  # last: the build runs beside training, not beside this boundary
                self._layouts.start_build()
            return
        try:
            suffix = self.host_suffix(step)
        except RuntimeError:
            # While a blocking stream captures a CUDA graph, torch's reads of the CUDA
            # RNG state raise cudaErrorStreamCaptureImplicit (the legacy stream would
            # join the capture): skip this step, as submit does for a capturing stream.
            cuda = self._backend.cuda
            if cuda is None or not cuda.capturing():
                raise
            self._counters.skipped += 1
            log.warning("step %d not snapshotted: a stream is capturing a CUDA graph (the "
                        "CUDA RNG state cannot be read meanwhile); call boundary() outside "
                        "graph capture", step)
            return
        not_ready = self._counters.skipped_not_ready
        if self.submit(lay, step, suffix) is not None:
            self._counters.record_boundary(t0)
        elif self._counters.skipped_not_ready != not_ready:
            # No arena yet: until the next optimizer step the live state IS this step,
            # which a flush, trigger or close() meanwhile copies (cudasnap.core.early).
            self.live.record(step, b"".join(suffix), unprotected=True)

    def host_suffix(self, step: int) -> list[bytes]:
        """The per-boundary end of the slot manifest, host state + step, in pieces that
        the copy engine writes one after the other (no joined copy: see HostText.parts).

        Capture, then encode: the host state is captured first, reading only the RNG
        sources whose bytes changed since the last boundary
        (cudasnap.core.host_capture.HostText.capture), then the finished record is written
        (cudasnap.format.slot_manifest.suffix_pieces)."""
        st = self.state
        ht = self._host_text
        if ht is None or ht.sources != st.rng_sources:
            ht = self._host_text = HostText(st.rng_sources, capture_rng)
        return suffix_pieces(ht.capture(st), step)

    def submit(self, lay: Layout, step: int, suffix: bytes | list[bytes],
               still_clean: Callable[[], bool] | None = None) -> CopyJob | None:
        """Hands one snapshot to the copy engine; returns the job (None: skipped).
        ``suffix``: the manifest's host part, whole or in pieces. ``still_clean`` (a copy of
        the live state): asked last before the engine is handed the job; False skips it."""
        n = lay.prefix_len + (len(suffix) if isinstance(suffix, bytes) else sum(map(len, suffix)))
        keeper = self._keeper
        ok = lay.arena_ok
        # ArenaKeeper.ensure() returns an arena only while no set-up runs or waits to be
        # taken, and only ensure() (or the constructor, before any arena) starts one:
        # while the arena it returned for this layout is still current and a meta area
        # as large suffices, it would return the same arena (its "fits" branch): skip it.
        # Kept on the layout (a new plan asks again) as the arena's id: no reference to
        # it is held (a regrowth unmaps the old arena first), and keeper.arena changes
        # only in ensure() and close(), so the id is not reused meanwhile.
        # (no reference to keeper.arena is taken before ensure(): a regrowth unmaps it)
        arena = keeper.arena if ok is not None and ok[0] == id(keeper.arena) and n <= ok[1] \
            else None
        if arena is None:
            lay.arena_ok = None
            arena = keeper.ensure(lay.plan, n, step)
            if arena is None:
                self._counters.skipped += 1
                return None
            if arena is keeper.arena:
                lay.arena_ok = (id(arena), int(arena.meta_capacity))
        be = self._backend
        if self._writers and be.cuda is not None:
            why = be.cuda.follow(self._writers)  # the copy follows their queued writes too
            if why is not None:
                self._counters.skipped += 1
                log.warning("step %d not snapshotted: %s; call boundary() outside graph "
                            "capture", step, why)
                return None
        if still_clean is not None and not still_clean():
            log.info("JIT flush: the state moved past step %d while its copy was prepared; "
                     "not copied", step)
            return None
        with self.slot_lock:  # held only to pick the slot (never across CUDA calls)
            slot = arena.pick_write_slot()
        if slot < 0:
            self._counters.skipped += 1
            log.warning("step %d not snapshotted: every slot is busy (flush in progress)", step)
            return None
        stream = be.cuda.current_stream() if be.cuda is not None else 0
        try:
            if be.cuda is not None and be.device_staging:
                be.cuda.stage(lay.total_bytes)  # snapshot-then-offload (CudaBackend.stage)
            # begin_write() inside refuses a slot a concurrent flush leased since
            # the pick (the arena's own lock orders the two): StagingError.
            job = be.engine.submit(arena, slot, lay.plan, int(step), suffix, stream,
                                   lay.prefix)  # positional: (meta suffix, stream, prefix)
        except StagingError as e:
            self._counters.skipped += 1
            log.warning("step %d not snapshotted: %s", step, e)
            self._hold_if_hung(lay)
            return None
        except BaseException:
            self._hold_if_hung(lay)
            raise
        with self.slot_lock:
            self.fenced = [False, False]
            self.job = job
            # Holds every planned storage until the job is COMPLETE, or, failed, until
            # the engine has drained it (Layouts.job_done); accepted: earlier copies are over.
            self._layouts.running_job(lay)
        self._counters.snapshots += 1
        self._counters.bytes = lay.total_bytes
        return job

    def _hold_if_hung(self, lay: Layout) -> None:
        """A refused CUDA submit drains what it issued, unless that wait timed out (the
        GPU hung): then its DMA may still read ``lay``'s storages."""
        if self._backend.hung():
            self._layouts.hold_draining(lay)

    # ---------------------------------------------------- synchronize_staging()
    def fence(self, phase: int) -> None:
        """Waits for ``phase`` of the running copy (0: buffers, 1: parameters and optimizer
        state) before the caller writes it; bounded by ``wait_timeout_s`` (then that
        snapshot is abandoned, logged)."""
        # Every caller is about to write the state: the live state is no longer the
        # last boundary's (marked before a running copy of it is looked for).
        ev = self.live.mark_dirty()
        if ev is not None:  # a flush copies the live state right now: let it finish
            ev.wait(self.wait_timeout_s)
        job = self.job  # read after that wait: the live copy's own job, if it submitted one
        if job is None or self.fenced[phase]:
            return  # the common case (a forward hook per buffer-owning module): no wait
        t0 = time.perf_counter_ns()
        cuda = self._backend.cuda
        stream = cuda.current_stream() if cuda is not None else 0
        ok = self._backend.engine.fence(job, phase, stream)
        for s in self._writers if cuda is not None else ():
            ok = self._backend.engine.fence(job, phase, int(s.cuda_stream)) and ok
        if not ok:
            self._counters.abandoned += 1
            log.error("snapshot of step %d abandoned: its copy did not reach phase %d within "
                      "%.0f s (copier stalled or GPU hung); the previous snapshot stays the "
                      "newest", job.step, phase, self.wait_timeout_s)
        self.fenced[phase] = True
        if phase == 1:
            self.fenced[0] = True
        self._counters.fence_wait_ns += time.perf_counter_ns() - t0

    def settle_deferred(self, timeout: float | None) -> None:
        """``wait()``, ``close()``: the newest boundary was not copied (the cadence skipped
        it, or its plan was being built off the training thread); when no optimizer step
        ran since, copy its live state now (a build is waited for), so ``wait()`` returns
        with that step COMPLETE, as it did when every boundary copied."""
        if self.live.pending() is not None and self.live.clean():
            self.copy_live(timeout)

    def wait_job(self, timeout: float | None = None) -> bool:
        """Blocks until the running copy is COMPLETE (True; also when none runs or it
        failed) or ``timeout`` passes (False), and retires it."""
        job = self.job
        if job is None:
            return True
        t0 = time.perf_counter_ns()
        failed = False
        try:
            ok = job.wait(1, -1.0 if timeout is None else timeout)
        except SnapshotError as e:
            log.error("snapshot of step %d failed: %s", job.step, e)
            ok = failed = True
        c = self._counters
        c.fence_wait_ns += time.perf_counter_ns() - t0
        if ok:
            secs = job.seconds_to_complete
            c.last_copy_seconds = secs
            if secs and secs > 0:
                c.last_copy_gbps = job.bytes / secs / 1e9
            # Another thread (a flush) may wait too: retire only the job we waited on.
            with self.slot_lock:
                if self.job is job:
                    self._layouts.job_done(failed)
                    self.job = None
                    self.fenced = [True, True]
        return ok

    # -------------------------------------------------- the live state (flush)
    def forget_live(self) -> None:
        """The live state is about to be replaced (a restore): no JIT copy of it."""
        self.live.clear()

    def copy_live(self, timeout: float | None) -> None:
        """The newest boundary was not copied; when no optimizer step (nor buffer forward,
        fence, load) ran since, the live tensors still hold that step, so copy them into a
        free slot now (same manifest, format and commit path) for the flush to write.
        Otherwise the newest COMPLETE slot is flushed (replay <= k steps)."""
        live = self.live
        if live.pending() is None or (self._keeper.arena is None and not live.deferred):
            return  # nothing skipped, or no arena yet: the EarlySaver makes it first
        with live.claim() as claimed:
            if claimed is None or not self.wait_job(timeout):
                return
            step, suffix = claimed
            try:
                lay = self._layouts.current()
            except SnapshotError as e:
                log.warning("JIT flush: live state of step %d not copied: %s", step, e)
                return
            # still_clean: checked again right before the engine reads the tensors (the
            # plan or a regrowth may have taken longer than a writer waits for this copy)
            job = self.submit(lay, step, suffix, still_clean=live.clean)
            if job is None or not self.wait_job(timeout if timeout is not None else
                                                self.wait_timeout_s):
                return
            live.copied(claimed)
            self._counters.live_saves += 1
            log.info("JIT flush: copied the live state of step %d (not snapshotted at its "
                     "boundary: %s)", step, "its copy plan was being built" if
                     live.deferred else f"snapshot every {self.cadence.k} boundaries")
