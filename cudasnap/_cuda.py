"""Glue for the CUDA path: copy engine, staging registration, allocator tracking.

Used by :class:`cudasnap.Snapshotter` when the state lives on a GPU. Importing
this module never initialises CUDA (torch and the engine load lazily, inside
the methods).

The allocator registry (``cudasnap._C.AllocatorRegistry``) coalesces device
ranges for the copy plan and reports coverage. The boundary's layout check is
``LayoutGuard.boundary_check`` (cudasnap.core.plan_cache), which runs on every backend.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._native import native
from .errors import ConfigError, SnapshotError
from .format.manifest import span_bytes

if TYPE_CHECKING:  # type-only: importing this module loads neither torch nor the extension
    import torch

    from cudasnap._C import AllocatorRegistry, Arena, CudaCopyEngine

#: per span: (block addr, block size, segment addr, segment size), or why it is not tracked
Located = tuple[int, int, int, int] | str
#: coalesce(): (ranges [(addr, nbytes)], placement [(range index, offset)])
Coalesced = tuple[list[tuple[int, int]], list[tuple[int, int]]]

log = logging.getLogger("cudasnap")

#: default queue length at which the registry's drain thread applies events
AUTO_DRAIN_EVENTS = 16384


def tensor_span_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly strided) tensor view spans in its storage (the manifest's rule,
    ``cudasnap.format.manifest.span_bytes``)."""
    return span_bytes(list(t.shape), list(t.stride()), t.element_size())


def _spans(items: Iterable[Any], index: int | None = None) -> list[tuple[int, int]]:
    """(address, nbytes) pairs from pairs, tensors or LiveTensor-like objects.

    Tensors not on CUDA device ``index`` (when given) are left out.
    """
    out: list[tuple[int, int]] = []
    for it in items:
        if isinstance(it, (tuple, list)):
            out.append((int(it[0]), int(it[1])))
            continue
        t = getattr(it, "tensor", it)
        if not getattr(t, "is_cuda", False):
            continue
        if index is not None and t.device.index != index:
            continue
        n = it.nbytes if t is not it else tensor_span_bytes(t)
        out.append((int(t.data_ptr()), int(n)))
    return out


def pin_arena(arena: Arena, device: int) -> tuple[Arena, str | None]:
    """Page-locks ``arena`` (cudaHostRegister) for DMA from ``device``: (arena, None).

    Where the shared-memory arena cannot be registered (VMs, gVisor, memlock
    limit) it returns, with a warning, a process-private pinned arena of the
    same geometry and the reason: (private arena, reason); such an arena does
    not outlive the process. Safe on any thread (the device is passed to every
    call); the background preparer calls it off the training thread.
    """
    C = native()
    if arena.cuda_registered:
        return arena, None
    ok, reason = C.register_arena(arena, int(device))
    if ok:
        return arena, None
    log.warning("cudasnap: cannot page-lock the shared-memory staging arena (%s); using a "
                "process-private pinned arena instead: snapshots will NOT survive a crash "
                "of this process (no flush by the supervisor; stats()['staging'] says "
                "survives_crash False). Fix: raise the locked-memory limit (`ulimit -l "
                "unlimited`, the container's memlock), or run where cudaHostRegister of "
                "shared memory is allowed (not gVisor)", reason)
    priv = C.create_private_pinned_arena(arena.num_slots, arena.data_capacity,
                                         arena.meta_capacity, arena.chunk_bytes, arena.job,
                                         int(device))
    if arena.newest_complete() < 0:
        arena.unlink()  # an empty file would only hold shared memory
    return priv, str(reason)


class CudaBackend:
    """The CUDA copy engine of one device, its staging arena and allocator tracking."""

    def __init__(self, device: torch.device | str | int, crc_threads: int = 4, *, track: bool = True,
                 gather_small: bool = False, auto_drain: int = AUTO_DRAIN_EVENTS,
                 wait_timeout_s: float = 120.0, device_staging: int | str = 0) -> None:
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"CudaBackend needs a CUDA device, got {dev}")
        torch.cuda.init()  # lazy init: the caching allocator must exist before attaching
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.index = int(index)
        C = native()
        self.engine: CudaCopyEngine = C.CudaCopyEngine(self.index, int(crc_threads), bool(gather_small))
        self.engine.wait_timeout_s = float(wait_timeout_s)
        self.registry: AllocatorRegistry | None = None
        self.tracker_error: str | None = None
        self.fallback_reason: str | None = None  # why the arena is process-private
        self._copy_stream: Any = None  # the engine's copy stream as a torch stream (follow)
        self._arenas: list[Arena] = []  # arenas we cudaHostRegister'ed (held until unregistered)
        self._closed = False
        # Snapshot-then-offload (stage()): the limit (bytes, or "auto" until the first
        # stage() resolves it) and the buffer, a tensor of torch's caching allocator.
        self._staging_limit: int | str = device_staging
        self._staging: Any = None
        self._stage_lock = threading.Lock()  # a boundary and a flush's live copy may race
        self.staging_reason: str | None = None  # why less than asked is staged
        if track:
            try:
                self.registry = C.attach_allocator_tracker(int(auto_drain))
            except SnapshotError as e:
                self.tracker_error = str(e)
                log.warning("cudasnap: allocator tracking unavailable (%s); copy plans are "
                            "checked against the named tensors instead", e)

    # ------------------------------------------------------------ staging
    def prepare_arena(self, arena: Arena | Callable[[], Arena], owner: object = None,
                      reason: str | None = None) -> Arena:
        """Page-locks ``arena`` (an Arena, or a callable returning one) for DMA.

        An arena already page-locked (by :func:`pin_arena` on the background
        preparer, or a private pinned one) is only taken into this backend's
        books, so close() unregisters it; ``reason`` is that preparer's fallback
        reason. Otherwise see :func:`pin_arena` (synchronous). Returns the arena.
        """
        C = native()
        if callable(arena) and not isinstance(arena, C.Arena):
            arena = arena()
        self._sweep()
        if reason:
            self.fallback_reason = reason
        if not arena.cuda_registered:
            arena, why = pin_arena(arena, self.index)
            if why:
                self.fallback_reason = why
        if arena.shared and not any(a is arena for a in self._arenas):
            self._arenas.append(arena)  # registered by us: unregistered before it is unmapped
        return arena

    def _sweep(self) -> None:
        """Unregisters arenas nobody but this backend references any more."""
        if self.engine.busy:
            return  # a DMA may still be writing into one of them
        C = native()
        for i in reversed(range(len(self._arenas))):
            if sys.getrefcount(self._arenas[i]) <= 2:  # the list's reference + the argument
                a = self._arenas.pop(i)
                try:
                    C.unregister_arena(a)
                except SnapshotError as e:
                    log.warning("cudasnap: cudaHostUnregister failed: %s", e)

    def release_arena(self, arena: Arena, timeout: float = 120.0) -> bool:
        """Unregisters ``arena`` now (waits up to ``timeout`` s for a running copy first).

        False (and the arena stays registered) when the copy is still running.
        """
        C = native()
        for i, a in enumerate(self._arenas):
            if a is arena:
                deadline = time.monotonic() + timeout
                while self.engine.busy:
                    if time.monotonic() > deadline:
                        log.error("cudasnap: cannot release the staging arena: a copy into "
                                  "it is still running after %.0f s", timeout)
                        return False
                    time.sleep(0.001)
                del self._arenas[i]
                C.unregister_arena(arena)
                return True
        return True

    # ---------------------------------------------------------- tracking
    def coverage(self, spans: Iterable[Any], top_n: int = 8) -> dict[str, Any]:
        """Live device bytes vs the bytes the spans cover (see AllocatorRegistry.coverage)."""
        if self.registry is None:
            return {"available": False, "reason": self.tracker_error, "device": self.index}
        d = dict(self.registry.coverage(self.index, _spans(spans, self.index), int(top_n)))
        d["available"] = True
        d["device"] = self.index
        return d

    def locate(self, spans: Iterable[Any]) -> list[Located]:
        """Per span: (block_addr, block_size, segment_addr, segment_size) or an error string."""
        if self.registry is None:
            return [f"allocator tracking unavailable: {self.tracker_error}"
                    for _ in _spans(spans, self.index)]
        return list(self.registry.locate(self.index, _spans(spans, self.index)))

    def locate_ok(self, spans: Iterable[Any]) -> bool:
        """True when every span lies in a live block the registry tracks."""
        if self.registry is None:
            return False
        bad = [r for r in self.registry.locate(self.index, _spans(spans, self.index))
               if isinstance(r, str)]
        if bad:
            log.info("cudasnap: %d state span(s) not in tracked blocks (first: %s); using "
                     "named-tensor spans", len(bad), bad[0])
        return not bad

    def coalesce(self, spans: Iterable[Any], merge_gap: int = 4096) -> Coalesced:
        """(ranges, placement): spans merged within segments (never across)."""
        if self.registry is None:
            raise SnapshotError(f"allocator tracking unavailable: {self.tracker_error}")
        return self.registry.coalesce(self.index, _spans(spans, self.index), int(merge_gap))

    # ------------------------------------------------------------ streams
    def current_stream(self) -> int:
        """Handle of the current compute stream of this device (cudaStream_t as int)."""
        import torch

        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def check_writer(self, stream: Any) -> None:
        """ConfigError unless ``stream`` is on this backend's device."""
        if stream.device != self.device:
            raise ConfigError(f"writer stream {stream} is on {stream.device}, the state on "
                              f"{self.device}")

    def follow(self, streams: list[Any]) -> str | None:
        """The copy stream waits for the work queued so far on each of ``streams`` (events,
        no host block; the trainer's streams are left alone): the next snapshot's copies,
        queued after this, also follow their writes. Returns why not (a stream is
        capturing a CUDA graph: an event recorded there would join the copy stream to
        the capture), or None."""
        import torch

        for s in streams:
            self.check_writer(s)
            with torch.cuda.stream(s):
                if torch.cuda.is_current_stream_capturing():
                    return f"writer stream {s} is capturing a CUDA graph"
        copy = self._copy_stream
        if copy is None or copy.cuda_stream != self.engine.copy_stream:
            copy = self._copy_stream = torch.cuda.ExternalStream(self.engine.copy_stream,
                                                                 device=self.device)
        for s in streams:
            copy.wait_stream(s)
        return None

    def capturing(self) -> bool:
        """Whether this device's current stream is capturing a CUDA graph, counting the
        legacy default stream while a blocking stream captures: its work would join that
        capture, and torch calls that touch it raise cudaErrorStreamCaptureImplicit then
        (``torch.cuda.get_rng_state_all()`` among them). A boundary that sees True skips
        the snapshot; ``engine.submit`` refuses such a stream too (StagingError)."""
        import torch

        with torch.cuda.device(self.index):
            try:
                return bool(torch.cuda.is_current_stream_capturing())
            except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError
                if "cudaErrorStreamCaptureImplicit" in str(e) or "capturing blocking stream" in str(e):
                    return True  # torch's check cleared the (non-sticky) error
                raise

    def stage(self, nbytes: int) -> int:
        """Snapshot-then-offload: a device buffer for the first ``min(nbytes, limit)``
        bytes of each snapshot (0: off), taken from torch's caching allocator so training
        sees the memory it costs. "auto" is resolved here once: half the device memory
        free at the first snapshot (after a step, torch's cache holds the activations'
        peak, so that half is memory training did not need). Returns the bytes staged."""
        with self._stage_lock:
            return self._stage(nbytes)

    def _stage(self, nbytes: int) -> int:
        import torch

        limit = self._staging_limit
        if limit == "auto":
            free, _total = torch.cuda.mem_get_info(self.index)
            limit = self._staging_limit = int(free) // 2
            log.info("cudasnap: device staging auto: up to %.3g GB (half the free memory "
                     "of cuda:%d)", limit / 1e9, self.index)
        want = min(int(nbytes), int(limit))
        have = 0 if self._staging is None else int(self._staging.numel())
        if want <= have:
            return have if want else 0
        old = self._staging
        try:
            buf = torch.empty(want, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as e:
            self.staging_reason = f"{want} bytes of device staging did not fit: {e}"
            log.warning("cudasnap: %s; snapshots copy to the host directly", self.staging_reason)
            self._staging_limit = have  # not asked again
            return have
        # Waits for the running copy (it may read the old buffer) before the swap.
        self.engine.set_device_staging(int(buf.data_ptr()), want)
        self._staging = buf
        del old  # back to torch's cache: no copy reads it any more
        return want

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = {"device": self.index, "tracking": self.registry is not None,
                             "registered_arenas": len(self._arenas),
                             "private_arena_reason": self.fallback_reason,
                             "device_staging_bytes": int(self.engine.device_staging_bytes),
                             "last_staged_bytes": int(self.engine.last_staged),
                             "device_staging_reason": self.staging_reason}
        if self.registry is not None:
            s["registry"] = dict(self.registry.stats())
        return s

    def close(self, timeout: float = 120.0) -> None:
        """Waits (at most ``timeout`` s) for the running copy, stops the engine and
        unregisters the arenas; on a hung GPU it gives up instead of hanging."""
        if self._closed:
            return
        self._closed = True
        if not self.engine.shutdown(timeout) or self.engine.hung:
            log.error("cudasnap: the GPU did not finish the snapshot copy within %.0f s (hung "
                      "or lost); the copy was abandoned and the staging arena is left "
                      "registered (cudaHostUnregister could block on the device)", timeout)
            self._arenas.clear()
            return  # the staging buffer stays held too: a DMA may still read it
        self._staging = None
        C = native()
        while self._arenas:
            a = self._arenas.pop()
            try:
                C.unregister_arena(a)
            except SnapshotError as e:
                log.warning("cudasnap: cudaHostUnregister failed: %s", e)


__all__ = ["CudaBackend", "pin_arena", "tensor_span_bytes", "AUTO_DRAIN_EVENTS"]
