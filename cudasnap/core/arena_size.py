"""How large a staging arena must be: the size estimate and the capacities of a slot.

Owns :func:`estimate_state_bytes` (the slot bytes and tensor count the training state will
need once every optimizer has stepped, counting the state that known ``torch.optim``
optimizers create at their first step) and the rounding of a plan's bytes into slot and
manifest capacities (:func:`slot_capacity`, :func:`meta_capacity`,
:func:`estimate_meta_len`; the first two, and the chunk size that follows the state,
:func:`chunk_for`, live in cudasnap.core.slot_geometry, torch-free). Pure arithmetic: it
makes no arena and starts no thread.

Call order: ``cudasnap.core.arena_keeper.ArenaKeeper.start_at_construction`` (from the Snapshotter's
constructor) sizes the arena it prepares in the background with
``estimate_state_bytes`` -> ``slot_capacity`` / ``estimate_meta_len`` -> ``meta_capacity``;
``ArenaKeeper.ensure`` (each boundary, a flush) sizes it from the copy plan with
``slot_capacity`` and ``meta_capacity`` when the arena is missing or no longer fits.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import module_state, sharded, wrapped
from .slot_geometry import PAGE, chunk_for, meta_capacity, slot_capacity

if TYPE_CHECKING:
    from .state import TrainingState

__all__ = ["PAGE", "chunk_for", "estimate_meta_len", "estimate_state_bytes", "meta_capacity",
           "slot_capacity"]

# Per-parameter state tensors that known optimizers create at their first step:
# (full-size slots, scalar tensor slots) given the parameter group.
_Slots = Callable[[dict[str, object]], tuple[int, int]]
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


def estimate_state_bytes(state: TrainingState) -> tuple[int, int]:
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
        if sharded.is_dtensor(t):
            t = sharded.local_shard(t)
        if wrapped.is_wrapper(t):  # its inner tensors are what a slot holds (8-bit codes...)
            for a in t.__tensor_flatten__()[0]:  # type: ignore[attr-defined]
                add(getattr(t, a))
            return
        total += _span(t.numel() * t.element_size(), not t.is_cuda)
        count += 1

    for mod in state.models.values():
        for _, t, _ in module_state.entries(mod):
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


def estimate_meta_len(ntensors: int) -> int:
    """Manifest bytes: ~200 B per tensor entry plus the host state (RNG states, ...)."""
    return 256 * ntensors + (64 << 10)

