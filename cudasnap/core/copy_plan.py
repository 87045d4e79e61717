"""The copy plan of the live tensors (``make_plan``) and the ``Layout`` that caches it.

A ``Layout`` holds the planned tensors (alive while it lives), the native plan,
the manifest's tensor table (``prefix``, written once per slot) and the checks
that find it stale (``cudasnap.core.layout_watch``, the native ``LayoutGuard``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .. import config as cfg
from .._native import native
from ..errors import SnapshotError
from . import layout_watch
from .layout_watch import Watch
from .live_tensor import LiveTensor
from .slot_geometry import chunk_for

if TYPE_CHECKING:
    import torch

    from cudasnap._C import CopyPlan

    from .._cuda import CudaBackend

log = logging.getLogger("cudasnap")


class Layout:
    """Live tensors + their copy plan + the manifest prefix (written once per slot)."""

    def __init__(self, tensors: list[LiveTensor], plan: CopyPlan, prefix: bytes, watch: Watch,
                 rescan_every: int, optimizers: list[torch.optim.Optimizer] | None = None):
        self.tensors = tensors
        self.plan = plan
        self.total_bytes = int(plan.total_bytes)
        # The tensor table, held in C++: a slot that holds it gets only the host suffix.
        self.prefix = native().MetaPrefix(prefix)
        self.prefix_len = len(prefix)
        self.objects = [lt.tensor for lt in tensors]
        # What the re-scan compares (held): a subclass's object once, not per inner tensor.
        self.idents = [lt.ident for lt in tensors if lt.wrapper is None or lt.wrapper.first]
        self.tied = any(lt.aliases for lt in tensors)  # the re-scan drops repeats then
        self._scan: Iterator[list[torch.Tensor]] | None = None
        self._scan_at = 0
        # Every planned storage stays allocated while this layout lives, so a copy
        # of a plan not yet found stale (see layout_watch) never reads freed memory.
        # Aliases, not the objects: `p.data = x` / `p.set_(x)` replace the storage of
        # the Parameter object itself, the alias keeps the old one (the storage a
        # running copy reads). A running copy's layout is held until the engine is done
        # with it (cudasnap.core.fences); tests: test_storage_hold*.
        self.keep = [t.detach() for t in self.objects]
        self.guard = native().LayoutGuard(self.objects)
        self.watch = watch
        watch.attach(self.guard)  # identity window checked natively too
        # Full re-scan period: amortised O(1) per boundary whatever the tensor count.
        per = 4 * layout_watch.WINDOW
        self.rescan_every = rescan_every * max(1, -(-len(tensors) // per))
        self.guard.set_rescan_every(self.rescan_every)
        # The signature (len(opt.state) per optimizer: lazy optimizer init), checked
        # natively with the windows in one call per boundary (LayoutGuard.boundary_check).
        self.guard.set_sizes(list(optimizers or []), "state")
        # (id of the arena, its meta capacity) arena_prep.ensure() gave this plan
        # (cudasnap.core.copier.SubmitMixin._submit_copy); None: ask it.
        self.arena_ok: tuple[int, int] | None = None

    def same_objects(self, tensors: list[LiveTensor]) -> bool:
        return len(tensors) == len(self.objects) and all(
            a.tensor is b for a, b in zip(tensors, self.objects))

    def rescan(self, pieces: Iterator[list[torch.Tensor]] | None) -> bool | None:
        """One step of the periodic identity re-scan, spread over boundaries so that none
        pays for it all (at 40,000 tensors the whole walk is ~6 ms, ``live_tensors()``
        ~105 ms): ``pieces`` (``TrainingState.identity_pieces()``) starts a scan, None
        goes on with the running one. Returns False when a piece differs from the
        layout (a tensor added, removed or replaced: rebuild), True when the scan ended
        and every piece matched, None while it runs (or none runs). The layout holds its
        identity objects, so an id is never reused under it."""
        if pieces is not None and self._scan is None:
            self._scan, self._scan_at = pieces, 0
        it = self._scan
        if it is None:
            return None
        part = next(it, None)
        if part is None:
            self._scan = None
            return self._scan_at == len(self.idents)
        lo = self._scan_at
        self._scan_at = lo + len(part)
        if self._scan_at > len(self.idents) or any(
                a is not b for a, b in zip(part, self.idents[lo:self._scan_at])):
            self._scan = None
            return False
        return None


def make_plan(tensors: list[LiveTensor], cuda: CudaBackend | None,
              chunk: int | Callable[[int], int] | None) -> tuple[CopyPlan, list[int]]:
    """Copy plan + each tensor's offset in the slot. ``chunk``: the chunk size, or a
    function of the plan's bytes that gives it (``ArenaKeeper.chunk``), or None: it follows
    the plan's bytes (cudasnap.core.slot_geometry.chunk_for).

    Host spans merge across small gaps. Device spans never merge across
    allocator segments (a gap between two cudaMalloc segments may be
    unmapped): with allocator tracking (``cuda``: the CUDA backend, or None)
    they are coalesced by the registry within segments; without it only
    overlapping spans merge.
    """
    C = native()
    host: list[int] = []
    dev: list[int] = []
    ptrs: list[int] = []
    sizes: list[int] = []
    phases: list[int] = []
    where: list[tuple[int, int]] = [(-1, 0)] * len(tensors)
    for i, lt in enumerate(tensors):  # one pass: ~1 us a tensor (a layout build's share)
        t = lt.tensor
        if t.is_cuda:
            dev.append(i)
            continue
        where[i] = (len(host), 0)
        host.append(i)
        ptrs.append(t.data_ptr())
        sizes.append(lt.nbytes)
        phases.append(lt.phase)
    if dev:
        ranges = placement = None
        if cuda is not None and cuda.registry is not None:
            try:
                ranges, placement = cuda.coalesce([tensors[i] for i in dev], 4096)
            except SnapshotError as e:
                log.warning("allocator-tracked coalescing unavailable (%s); "
                            "copying tensor by tensor", e)
        if ranges is None or placement is None:
            ranges = [(tensors[i].tensor.data_ptr(), tensors[i].nbytes) for i in dev]
            placement = [(k, 0) for k in range(len(dev))]
        base = len(ptrs)
        rphase = [1] * len(ranges)
        for i, (r, _) in zip(dev, placement):
            if r >= 0:
                rphase[r] = min(rphase[r], tensors[i].phase)  # a buffer inside: fence early
        for (addr, n), ph in zip(ranges, rphase):
            ptrs.append(int(addr))
            sizes.append(int(n))
            phases.append(ph)
        for i, (r, off) in zip(dev, placement):
            where[i] = (base + r, int(off)) if r >= 0 else (-1, 0)
    is_host = [True] * len(host) + [False] * (len(ptrs) - len(host))
    # Host spans may merge across small gaps; with device ranges present the
    # gap is 0 so ranges from different segments never merge.
    gap = 0 if dev else 4096
    fixed = chunk if isinstance(chunk, int) else cfg.CHUNK_BYTES
    plan = C.build_plan(ptrs, sizes, phases, is_host, fixed, gap, 4096)
    if not isinstance(chunk, int):  # the ranges do not depend on the chunk: a plan whose
        pick = chunk_for if chunk is None else chunk  # bytes want another is built again
        want = pick(int(plan.total_bytes))
        if want != plan.chunk_bytes:
            plan = C.build_plan(ptrs, sizes, phases, is_host, want, gap, 4096)
    offs = plan.tensor_offsets
    offsets = [offs[r] + off if r >= 0 else 0 for r, off in where]
    return plan, offsets
