"""Fences: no write of the state overtakes the running snapshot copy.

The copy of step N runs in the background. Every writer of the state waits for
the phase of that copy it would overwrite: the optimizer's step pre-hook and
``load_state_dict`` pre-hook (phase 1: parameters and optimizer state), the
forward pre-hook of every module owning buffers (phase 0: buffers), and the
explicit ``Snapshotter.fence()``. A wait longer than ``wait_timeout_s``
abandons that snapshot (logged), so a stalled copier never hangs training.

Under ``torch.compile`` (Dynamo traces the hooks into the graph) a hook emits the
custom op ``cudasnap::fence(key, phase, state)`` instead of calling ``_fence``:
Dynamo keeps it in the graph (no graph break, ``fullgraph=True`` works), and since
it is declared to mutate ``state`` (the module's own buffers, or the optimizer's
parameters) every later write of those tensors depends on it, so neither dead-code
elimination nor Inductor's scheduling can drop it or move a write ahead of it.
It never writes them. See docs/design.md §3.2.1.

Storage lifetime: the copy reads the planned tensors' memory by address, so the
job's ``Layout`` (``cudasnap.core.plan``: it holds every planned storage) is kept
until the copy can no longer read it: until the job is COMPLETE, and for a failed
or cancelled job until the engine has drained (``_hold_draining``). Only then may
``p.data = ...``, ``set_()`` or a swapped optimizer state free a block it read.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import SnapshotError
from .shared import Fields

if TYPE_CHECKING:
    from .plan import Layout

log = logging.getLogger("cudasnap")

# Layouts of copies a closed Snapshotter left running on a hung GPU: the DMA may
# still read their storages, so they are never freed (process lifetime, logged).
_ABANDONED: list[Layout] = []

# Snapshotters by the key their compiled fences carry (a graph holds an int, not the object).
_BY_KEY: weakref.WeakValueDictionary[int, FencesMixin] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_FENCE_OP: Any = None


def fence_op() -> Any:
    """``torch.ops.cudasnap.fence.default``, registered on first use.

    ``fence(key, phase, state)`` runs ``_fence(phase)`` of the Snapshotter ``key``
    names (a no-op once it is gone). ``state`` is declared mutated and is never
    written: the declaration orders every later write of ``state`` in a compiled
    graph after the fence and keeps the op from dead-code elimination (Inductor
    re-inplaces it: no copy of ``state``)."""
    global _FENCE_OP
    if _FENCE_OP is None:
        import torch

        # (explicit schema: this module's annotations are strings)
        @torch.library.custom_op("cudasnap::fence", mutates_args=("state",),
                                 schema="(int key, int phase, Tensor(a!)[] state) -> ()")
        def _fence_impl(key: int, phase: int, state: list[torch.Tensor]) -> None:
            snap = _BY_KEY.get(key)
            if snap is not None:
                snap._fence(phase)

        @_fence_impl.register_fake
        def _fence_fake(key: int, phase: int, state: list[torch.Tensor]) -> None:
            return None

        _FENCE_OP = torch.ops.cudasnap.fence.default
    return _FENCE_OP


class FencesMixin(Fields):
    # Layouts of failed or cancelled copies that may still read them (see _hold_draining).
    _draining: tuple[Layout, ...] = ()

    def _install_fences(self) -> None:
        import torch

        key = next(_KEYS)
        _BY_KEY[key] = self
        op = fence_op()
        # False when called (24 ns, a constant function), True while Dynamo traces (it
        # folds the call): the eager hot path pays no more than a call.
        compiling = torch.compiler.is_dynamo_compiling
        plain = (torch.Tensor, torch.nn.Parameter)
        token = [torch.empty(0)]  # for a call with no plain tensor (never dead code)

        def _state(ts: Any) -> list[Any]:
            # Plain tensors only: a wrapper subclass (DTensor, FSDP2/TP) would need a
            # rule for the op; its writes stay ordered by program order / torch.optim's
            # graph break (docs/design.md §3.2.1).
            return [t for t in ts if type(t) in plain] or token

        def step_pre(o: Any, *_: Any) -> None:
            if compiling():  # traced (torch.compile(opt.step)): the op joins the graph
                with torch.no_grad():
                    op(key, 1, _state(p for g in o.param_groups for p in g["params"]))
                return
            self._fence(1)

        def forward_pre(module: Any, _: Any) -> None:
            if compiling():  # traced: fence before this module's own buffers are written
                bufs = list(module.buffers(False))
                if bufs:
                    op(key, 0, _state(bufs))
                return
            # Eager: _fence's no-op case inline (the common one), in _fence's order:
            # mark dirty first, then look for a flush's live copy.
            self._live_dirty = True
            if self._live_copy is None and (self._job is None or self._fenced[0]):
                return
            self._fence(0)

        for opt in self.state.optimizers.values():
            self._hooks.append(opt.register_step_pre_hook(step_pre))
            self._hooks.append(opt.register_load_state_dict_pre_hook(self._before_load))
            self._hooks.append(opt.register_load_state_dict_post_hook(
                lambda *_: self.invalidate_layout()))
        for mod in self.state.models.values():
            seen = set()
            for sub in [mod, *[m for m in mod.modules() if any(True for _ in m.buffers(False))]]:
                if id(sub) not in seen:
                    seen.add(id(sub))
                    self._hooks.append(sub.register_forward_pre_hook(forward_pre))

    def _before_load(self, *_: Any) -> None:
        self._fence(1)  # never let load_state_dict race a running copy

    def fence(self) -> None:
        """Orders the caller's next writes of the state after the running copy.

        Call it before writing state tensors in a way the optimizer-step and
        forward hooks do not see: an EMA ``lerp_``/``copy_`` outside
        ``optimizer.step()``, manual edits, a CUDA-graph replay of the step.
        CUDA backend: the current stream waits on the copy (no host block);
        CPU backend: a host wait. A no-op when no copy is running. A wait longer
        than ``wait_timeout_s`` abandons that snapshot (logged) instead of hanging.
        """
        self._fence(1)

    def _fence(self, phase: int) -> None:
        # Every caller is about to write the state: the live state is no longer the
        # last boundary's. Set before the check below (a flush reads it the other way).
        self._live_dirty = True
        ev = self._live_copy
        if ev is not None:  # a flush copies the live state right now: let it finish
            ev.wait(self.wait_timeout_s)
        job = self._job
        if job is None or self._fenced[phase]:
            return
        t0 = time.perf_counter_ns()
        stream = self._cuda.current_stream() if self._cuda is not None else 0
        if not self._engine.fence(job, phase, stream):
            self._stats.abandoned += 1
            log.error("snapshot of step %d abandoned: its copy did not reach phase %d within "
                      "%.0f s (copier stalled or GPU hung); the previous snapshot stays the "
                      "newest", job.step, phase, self.wait_timeout_s)
        self._fenced[phase] = True
        if phase == 1:
            self._fenced[0] = True
        self._stats.fence_wait_ns += time.perf_counter_ns() - t0

    def _wait_job(self, timeout: float | None = None) -> bool:
        job = self._job
        if job is None:
            return True
        t0 = time.perf_counter_ns()
        failed = False
        try:
            ok = job.wait(1, -1.0 if timeout is None else timeout)
        except SnapshotError as e:
            log.error("snapshot of step %d failed: %s", job.step, e)
            ok = failed = True
        self._stats.fence_wait_ns += time.perf_counter_ns() - t0
        if ok:
            secs = job.seconds_to_complete
            self._stats.last_copy_seconds = secs
            if secs and secs > 0:
                self._stats.last_copy_gbps = job.bytes / secs / 1e9
            # Another thread (a flush) may wait too: retire only the job we waited on.
            with self._slot_lock:
                if self._job is job:
                    # (No local holds the layout: a logged error's traceback keeps this frame.)
                    if failed:
                        self._hold_draining(self._job_layout)
                    else:
                        # COMPLETE: its copy has drained, and so has every earlier one (one
                        # copy at a time; on CUDA in stream order): their layouts may go.
                        self._draining = ()
                    self._job = None
                    self._job_layout = None
                    self._fenced = [True, True]
        return ok

    def _hold_draining(self, lay: Layout | None) -> None:
        """Keeps the layout of a failed or cancelled copy (and so its storages) alive.

        A job fails as soon as it is cancelled (a fence's bounded wait ran out) or
        its completion wait timed out, while its copy may still be reading: CPU
        workers finish the chunk they are in, and a DMA already queued on the copy
        stream runs whenever the GPU gets to it. The layout is released when the
        engine is known to have drained it: the next accepted submit (see
        ``_release_drained``), the next COMPLETE job, or ``close()``.
        """
        if lay is not None and all(lay is not h for h in self._draining):
            self._draining = (*self._draining, lay)

    def _release_drained(self) -> None:
        """After the engine accepted a new job: the copies of the held layouts are over.

        The CPU engine accepts a job only once the previous one's workers finished;
        the CUDA engine only once its completion thread finished the previous job,
        which waits for that job's last DMA unless the GPU was declared hung (then
        the layouts stay until a later job completes, which is after them in stream
        order, or are abandoned at close)."""
        if self._draining and (self._cuda is None or not self._cuda.engine.hung):
            self._draining = ()

    def _release_at_close(self, drained: bool) -> None:
        """close(): the engine is stopped; ``drained``: no copy can still read the state."""
        held = [lay for lay in (*self._draining, self._job_layout) if lay is not None]
        self._draining = ()
        self._job_layout = None
        if held and not drained:
            _ABANDONED.extend(held)
            log.error("close(): a snapshot copy may still be reading the state (GPU hung); "
                      "its %d tensor(s) are kept allocated for the life of the process",
                      sum(len(lay.tensors) for lay in held))

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the running snapshot is COMPLETE (True) or the timeout passes."""
        return self._wait_job(timeout)
