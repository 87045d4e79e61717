"""Submit: ``boundary(step)`` captures host state and hands the cached copy plan to the engine.

``boundary()`` checks the step rule (``cudasnap.core.timeline``), encodes the
host state, picks a free slot of the arena and submits the copy; it returns at
once. The copy engine (CPU threads, or the CUDA backend's copy stream) is made
at the first boundary. Zero-overhead mode (``snapshot_every=k``) copies every
k-th boundary and remembers the others for a just-in-time flush (``flush``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from .._native import native
from ..errors import ConfigError, SnapshotError, StagingError
from ..format.slot_manifest import slot_tail
from . import early
from .host_capture import HostText
from .live_tensor import LiveTensor, single_cuda_device
from .plan import Layout
from .rng import capture_rng
from .shared import Fields
from .timeline import check_step

log = logging.getLogger("cudasnap")


class SubmitMixin(Fields):
    _host_text: HostText | None = None  # made at the first boundary
    def _ensure_engine(self, tensors: list[LiveTensor]) -> None:
        if self._engine is not None:
            return
        on_gpu = any(lt.tensor.is_cuda for lt in tensors)
        name = self._backend_name
        if name == "auto":
            name = "cuda" if on_gpu else "cpu"
        if name == "cpu" and on_gpu:
            raise ConfigError("backend='cpu' but some state lives on a CUDA device")
        if name == "cuda":
            from .._cuda import CudaBackend

            dev = single_cuda_device(tensors)
            self._cuda = CudaBackend(dev, crc_threads=self.copy_threads,
                                     wait_timeout_s=self.wait_timeout_s)
            self._engine = self._cuda.engine
        else:
            self._engine = native().CpuCopyEngine(self.copy_threads)
            self._engine.wait_timeout_s = self.wait_timeout_s
        self.backend = name
        log.info("cudasnap: %s backend, %d copy threads, arena %s", name, self.copy_threads,
                 self.arena_path)


    def copy_stream_handle(self) -> int | None:
        """The CUDA backend's copy stream (a ``cudaStream_t`` as an int, for profilers and
        benchmarks: ``torch.cuda.ExternalStream``); None before the first boundary or on CPU."""
        return int(self._cuda.engine.copy_stream) if self._cuda is not None else None

    def _stop_engine(self) -> None:
        """close(): stops the copy engine (bounded by ``wait_timeout_s``), then lets the
        copies' layouts go unless a DMA may still read them (a hung GPU)."""
        drained = True
        if self._cuda is not None:
            self._cuda.close(self.wait_timeout_s)
            drained = not self._cuda.engine.hung
        elif self._engine is not None and not self._engine.shutdown(self.wait_timeout_s):
            # The workers are joined either way: an abandoned copy reads nothing more.
            log.error("close(): the running snapshot copy was abandoned after %.0f s",
                      self.wait_timeout_s)
        self._release_at_close(drained)

    def boundary(self, step: int, **values: Any) -> None:
        """Snapshot the state after ``step``'s optimizer step; returns at once.

        ``values``: plain per-step state (JSON-able values, tensors) saved with the
        step and found in ``snap.values`` after a restore (cudasnap.core.values).

        ``step`` is a non-negative int, strictly above the previous boundary's step
        or, after ``restore_latest()``/``rollback()``, above the restored step;
        anything else raises ConfigError naming both steps (see cudasnap.core.timeline).
        """
        t0 = time.perf_counter_ns()
        if self._closed:
            raise SnapshotError("boundary() on a closed Snapshotter")
        last = self.last_step
        if type(step) is not int or last is None or step <= last or self._restored is not None:
            step = check_step(step, last, self._restored)  # the rule, or its error
        self._restored = None
        self._boundaries += 1
        self.last_step = step
        self._live_dirty = False  # set again by the next optimizer step / buffer forward
        self.state.step_values = values
        try:
            self._snapshot(step, t0)
        finally:
            ev = self._boundary_event  # a flush waiting for this boundary (cudasnap.core.early)
            if ev is not None:
                ev.set()
            # After the submit: a SIGTERM flush raised here waits for this very step.
            if self.guard is not None:
                self.guard.on_boundary(step)

    def _snapshot(self, step: int, t0: int) -> None:
        k = self.snapshot_every
        if k > 1 and (self._boundaries - 1) % k:
            # Zero-overhead mode: no copy. Until the next optimizer step the live
            # state IS this step, so a JIT flush copies it then (see flush()).
            self._stats.skipped_every += 1
            self._live = (step, b"".join(self._host_suffix(step)))
            self._record_ns(t0)
            return
        self._live = None
        # A previous copy still running (no optimizer step in between): bounded.
        if self._job is not None and not self._wait_job(self.wait_timeout_s):
            self._stats.skipped += 1
            log.warning("step %d not snapshotted: the previous copy is still running after "
                        "%.0f s", step, self.wait_timeout_s)
            return
        lay = self._current_layout()
        try:
            suffix = self._host_suffix(step)
        except RuntimeError:
            # While a blocking stream captures a CUDA graph, torch's reads of the CUDA
            # RNG state raise cudaErrorStreamCaptureImplicit (the legacy stream would
            # join the capture): skip this step, as submit does for a capturing stream.
            if self._cuda is None or not self._cuda.capturing():
                raise
            self._stats.skipped += 1
            log.warning("step %d not snapshotted: a stream is capturing a CUDA graph (the "
                        "CUDA RNG state cannot be read meanwhile); call boundary() outside "
                        "graph capture", step)
            return
        not_ready = self._stats.skipped_not_ready
        if self._submit_copy(lay, step, suffix) is not None:
            self._record_ns(t0)
        elif self._stats.skipped_not_ready != not_ready:
            # No arena yet: until the next optimizer step the live state IS this step,
            # which a flush, trigger or close() meanwhile copies (cudasnap.core.early).
            early.note_unprotected(self, step, suffix)

    def _host_suffix(self, step: int) -> list[bytes]:
        """The per-boundary end of the slot manifest, host state + step, in pieces that
        the copy engine writes one after the other (no joined copy: see HostText.parts;
        the bytes: cudasnap.format.slot_manifest).

        Reads only the RNG sources whose bytes changed since the last boundary
        (cudasnap.core.host_capture.HostText)."""
        st = self.state
        ht = self._host_text
        if ht is None or ht.sources != st.rng_sources:
            ht = self._host_text = HostText(st.rng_sources, capture_rng)
        parts = ht.parts(st, step)
        parts.append(slot_tail(step))
        return parts

    def _submit_copy(self, lay: Layout, step: int, suffix: bytes | list[bytes]) -> Any:
        """Hands one snapshot to the copy engine; returns the job (None: skipped).
        ``suffix``: the manifest's host part, whole or in pieces."""
        n = lay.prefix_len + (len(suffix) if isinstance(suffix, bytes) else sum(map(len, suffix)))
        ok = lay.arena_ok
        # arena_prep.ensure() returns an arena only while no set-up runs or waits to be
        # taken, and only ensure() (or the constructor, before any arena) starts one:
        # while the arena it returned for this layout is still current and a meta area
        # as large suffices, it would return the same arena (its "fits" branch): skip it.
        # Kept on the layout (a new plan asks again) as the arena's id: no reference to
        # it is held (a regrowth unmaps the old arena first), and self._arena changes
        # only in ensure() and close(), so the id is not reused meanwhile.
        if ok is not None and ok[0] == id(self._arena) and n <= ok[1]:
            arena = self._arena
        else:
            lay.arena_ok = None
            arena = self._ensure_arena(lay.plan, n)
            if arena is None:
                self._stats.skipped += 1
                return None
            if arena is self._arena:
                lay.arena_ok = (id(arena), int(arena.meta_capacity))
        with self._slot_lock:  # held only to pick the slot (never across CUDA calls)
            slot = arena.pick_write_slot()
        if slot < 0:
            self._stats.skipped += 1
            log.warning("step %d not snapshotted: every slot is busy (flush in progress)", step)
            return None
        stream = self._cuda.current_stream() if self._cuda is not None else 0
        try:
            # begin_write() inside refuses a slot a concurrent flush leased since
            # the pick (the arena's own lock orders the two): StagingError.
            job = self._engine.submit(arena, slot, lay.plan, int(step), suffix, stream,
                                      lay.prefix)  # positional: (meta suffix, stream, prefix)
        except StagingError as e:
            self._stats.skipped += 1
            log.warning("step %d not snapshotted: %s", step, e)
            self._hold_if_hung(lay)
            return None
        except BaseException:
            self._hold_if_hung(lay)
            raise
        with self._slot_lock:
            self._fenced = [False, False]
            self._job = job
            # Holds every planned storage until the job is COMPLETE, or, failed, until
            # the engine has drained it (cudasnap.core.fences): one reference, O(1).
            self._job_layout = lay
            self._release_drained()  # accepted: earlier copies are over
        self._stats.snapshots += 1
        self._stats.bytes = lay.total_bytes
        return job

    def _hold_if_hung(self, lay: Layout) -> None:
        """A refused CUDA submit drains what it issued, unless that wait timed out (the
        GPU hung): then its DMA may still read ``lay``'s storages."""
        if self._cuda is not None and self._cuda.engine.hung:
            self._hold_draining(lay)

    def _record_ns(self, t0: int) -> None:
        self._stats.record_boundary(t0)

