"""The plan cache: the copy plan is rebuilt only when the state changed.

A ``Layout`` (``cudasnap.core.plan``) is built at the first boundary and reused
while the optimizer state's key counts hold and ``cudasnap.core.layout_watch`` (a window
of identity checks per boundary, plus a periodic full re-scan) sees no replaced
tensor.
"""
from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from ..errors import ConfigError, SnapshotError
from ..format import manifest as fmt
from ..format.manifest import tensor_entry, validate_tensors
from ..format.slot_manifest import encode_prefix
from . import layout_watch
from .layout_watch import Watch, identity_entries
from .live_tensor import single_cuda_device
from .plan import Layout, make_plan
from .shared import Fields

log = logging.getLogger("cudasnap")


class LayoutMixin(Fields):
    RESCAN_EVERY = 64

    def invalidate_layout(self) -> None:
        """Forces the copy plan to be rebuilt at the next boundary.

        Needed only after replacing state tensors outside ``optimizer.step()`` /
        ``load_state_dict`` (e.g. ``opt.state[p]["exp_avg"] = t``); such a
        replacement is otherwise found by the rotating identity check within
        ``ceil(n / layout_watch.WINDOW)`` boundaries (n: state tensors; each boundary
        checks a window of them), and tensors added to a module or an existing
        ``opt.state[p]`` only by the full re-scan every ``RESCAN_EVERY`` x
        ``max(1, ceil(n / (4 * WINDOW)))`` boundaries (see core.plan.Layout). The
        running copy keeps reading the old tensors, which stay alive until it completes.
        """
        self._layout = None

    def coverage(self) -> dict[str, Any]:
        """Live device bytes vs bytes covered by the registered state (CUDA backend)."""
        if self._cuda is None:
            raise SnapshotError("coverage() needs the CUDA backend (state on a GPU)")
        lay = self._current_layout()
        cov: dict[str, Any] = self._cuda.coverage(lay.tensors)
        return cov

    def _layout_info(self) -> dict[str, Any] | None:
        """``stats()["layout"]``: the current plan's tensors and copy ranges (None: no plan)."""
        lay = self._layout
        if lay is None:
            return None
        return {"tensors": len(lay.tensors), "copy_ranges": int(lay.plan.num_ranges),
                "allocator_tracking": self._cuda is not None and self._cuda.registry is not None}

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
        if self._backend_name == "cpu":  # its copy workers read host memory only
            on_gpu = next((lt.name for lt in tensors if lt.tensor.is_cuda), None)
            if on_gpu is not None:
                raise ConfigError(f"backend='cpu' but {on_gpu} lives on a CUDA device: move "
                                  "it to the CPU, or use backend='cuda' (or 'auto')")
        self._ensure_engine(tensors)
        if self._cuda is not None:
            single_cuda_device(tensors, self._cuda.index)
        plan, offsets = make_plan(tensors, self._cuda, self.chunk_bytes)
        entries = []
        for lt, off in zip(tensors, offsets):
            e = tensor_entry(lt.name, lt.group, lt.tensor, off, lt.phase, lt.nbytes)
            if lt.param_index is not None:
                e["param_index"], e["state_key"] = lt.param_index, lt.state_key
            if lt.aliases:
                e["aliases"] = lt.aliases
            if lt.shard is not None:  # a DTensor's local shard (cudasnap.core.sharded)
                e["shard"] = lt.shard
            entries.append(e)
        validate_tensors(entries, plan.total_bytes, "layout")
        head = fmt.head(rank=self.rank, world_size=self.world_size, job=self.job,
                        backend=self.backend, torch=torch.__version__,
                        dcp_names=self.state.dcp_names())
        prefix = encode_prefix(head, entries)  # the slot manifest up to its host value
        self._stats.layout_rebuilds += 1
        log.debug("layout: %d tensors, %d copy ranges, %.1f MB", len(tensors), plan.num_ranges,
                  plan.total_bytes / 1e6)
        return Layout(tensors, plan, prefix, Watch(identity_entries(self.state, tensors)),
                      self.RESCAN_EVERY, list(self.state.optimizers.values()))

    def _current_layout(self) -> Layout:
        lay = self._layout
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
        self._layout = self._build_layout()
        return self._layout
