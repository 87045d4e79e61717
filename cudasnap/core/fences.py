"""Fences: no write of the state overtakes the running snapshot copy.

The copy of step N runs in the background. Every writer of the state waits for
the phase of that copy it would overwrite: the optimizer's step pre-hook and
``load_state_dict`` pre-hook (phase 1: parameters and optimizer state), the
forward pre-hook of every module owning buffers (phase 0: buffers), and the
explicit ``Snapshotter.fence()``. Each calls ``Copier.fence(phase)``
(cudasnap.core.copier). A wait longer than ``wait_timeout_s`` abandons that
snapshot (logged), so a stalled copier never hangs training.

Under ``torch.compile`` (Dynamo traces the hooks into the graph) a hook emits the
custom op ``cudasnap::fence(key, phase, state)`` instead of calling ``fence``:
Dynamo keeps it in the graph (no graph break, ``fullgraph=True`` works), and since
it is declared to mutate ``state`` (the module's own buffers, or the optimizer's
parameters) every later write of those tensors depends on it, so neither dead-code
elimination nor Inductor's scheduling can drop it or move a write ahead of it.
It never writes them. See docs/design.md §3.2.1.

Call order: the facade calls :func:`install` once at construction (after the
``Copier`` exists) and removes the returned hook handles at ``close()``. The hooks
call ``copier.fence`` by attribute at each call.
How long the copied tensors are held: ``cudasnap.core.plan_cache.Layouts``.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from . import optim_wrap

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from .copier import Copier
    from .state import TrainingState

# Copiers by the key their compiled fences carry (a graph holds an int, not the object).
_BY_KEY: weakref.WeakValueDictionary[int, Copier] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
FenceOp = Callable[[int, int, "list[torch.Tensor]"], None]
_FENCE_OP: FenceOp | None = None


def fence_op() -> FenceOp:
    """``torch.ops.cudasnap.fence.default``, registered on first use.

    ``fence(key, phase, state)`` runs ``fence(phase)`` of the Copier ``key``
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
            copier = _BY_KEY.get(key)
            if copier is not None:
                copier.fence(phase)

        @_fence_impl.register_fake
        def _fence_fake(key: int, phase: int, state: list[torch.Tensor]) -> None:
            return None

        _FENCE_OP = torch.ops.cudasnap.fence.default
    return _FENCE_OP


def install(state: TrainingState, copier: Copier,
            invalidate: Callable[[], None]) -> list[RemovableHandle]:
    """The fence hooks of ``state``'s optimizers and buffer-owning modules, calling
    ``copier.fence``; ``invalidate``: after an optimizer's ``load_state_dict`` (the plan
    is rebuilt). Returns the hook handles (``close()`` removes them)."""
    import torch

    key = next(_KEYS)
    _BY_KEY[key] = copier
    op = fence_op()
    # False when called (24 ns, a constant function), True while Dynamo traces (it
    # folds the call): the eager hot path pays no more than a call.
    compiling = torch.compiler.is_dynamo_compiling
    plain = (torch.Tensor, torch.nn.Parameter)
    token = [torch.empty(0)]  # for a call with no plain tensor (never dead code)

    def _state(ts: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        # Plain tensors only: a wrapper subclass (DTensor, FSDP2/TP) would need a
        # rule for the op; its writes stay ordered by program order / torch.optim's
        # graph break (docs/design.md §3.2.1).
        return [t for t in ts if type(t) in plain] or token

    restored_rng = state.restored_rng

    def step_pre(o: torch.optim.Optimizer, *_: object) -> None:
        if compiling():  # traced (torch.compile(opt.step)): the op joins the graph
            with torch.no_grad():
                op(key, 1, _state(p for g in o.param_groups for p in g["params"]))
            return
        if restored_rng.armed:  # a step before any forward
            restored_rng.no_forward()
        copier.fence(1)

    def forward_pre(module: torch.nn.Module, _: object) -> None:
        if compiling():  # traced: fence before this module's own buffers are written
            bufs = list(module.buffers(False))
            if bufs:
                op(key, 0, _state(bufs))
            return
        copier.fence(0)  # eager (its no-op case, the common one, is its first lines)

    def model_forward_pre(module: torch.nn.Module, args: object) -> None:
        # A registered model's own forward (never an activation checkpoint's recompute of a
        # block inside it): after a restore it puts RNG states back, after a boundary it
        # probes them (cudasnap.core.rng.RestoredRng)
        if not compiling() and restored_rng.armed:  # (traced: never read, so no guard on it)
            restored_rng.at_forward()
        forward_pre(module, args)

    def before_load(*_: object) -> None:
        copier.fence(1)  # never let load_state_dict race a running copy

    def first_step(key: str) -> Callable[..., None]:
        done = [False]

        def step_post(o: torch.optim.Optimizer, *_: object) -> None:
            if compiling():  # traced: the check is Python over the parameters
                return
            if not done[0]:  # once: is this a container cudasnap cannot see into?
                done[0] = True
                optim_wrap.check_stepped(key, o)
        return step_post

    hooks: list[RemovableHandle] = []
    for okey, opt in state.optimizers.items():
        hooks.append(opt.register_step_pre_hook(step_pre))
        hooks.append(opt.register_step_post_hook(first_step(okey)))
        hooks.append(opt.register_load_state_dict_pre_hook(before_load))
        hooks.append(opt.register_load_state_dict_post_hook(lambda *_: invalidate()))
    for mod in state.models.values():
        seen = set()
        for sub in [mod, *[m for m in mod.modules() if any(True for _ in m.buffers(False))]]:
            if id(sub) not in seen:
                seen.add(id(sub))
                hooks.append(sub.register_forward_pre_hook(
                    model_forward_pre if sub is mod else forward_pre))
    return hooks
