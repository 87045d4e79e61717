"""Per-boundary layout check that does not grow with the tensor count (issue 15, target 2).

The copy plan holds raw addresses of the state tensors. Two things can make it
stale between boundaries:

* a tensor's storage moves (``p.data = x``, ``t.set_()``, ``resize_``): its data
  pointer changes -- the C++ ``LayoutGuard`` compares pointers;
* a tensor object is replaced in its container (``opt.state[p]["exp_avg"] = t``,
  ``module.weight = Parameter(...)``): the old object keeps its pointer, so only
  an identity check of the container entry sees it.

Both checks run in C++ (``LayoutGuard``) over a rotating window of ``WINDOW``
tensors per boundary, so a boundary costs O(WINDOW) whatever the tensor count; every tensor is checked once
per ``ceil(n / WINDOW)`` boundaries (every boundary while ``n <= WINDOW``).
Meanwhile the layout keeps every planned storage alive (``keep``), so a copy of a
plan that went stale reads memory that is still allocated (the old values), never
freed memory. ``Snapshotter.invalidate_layout()`` makes a change visible at once.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .live_tensor import LiveTensor, _param_order
from .state import TrainingState

if TYPE_CHECKING:
    from cudasnap._C import LayoutGuard

WINDOW = 256

# (container, key, expected object): a module's ``_parameters``/``_buffers`` or an
# optimizer's ``state[p]``, the key the planned tensor is held under, the tensor.
IdentityEntry = tuple[Mapping[str, object], str | None, torch.Tensor]


def identity_entries(state: TrainingState, tensors: list[LiveTensor]) -> list[IdentityEntry]:
    """(container, key, expected object) for every planned tensor and optimizer state dict."""
    out: list[IdentityEntry] = []
    owners: dict[str, tuple[str, torch.nn.Module]] = {}
    for mkey, mod in state.models.items():
        owners[f"model:{mkey}"] = (mkey, mod)
    params: dict[str, list[torch.Tensor]] = {k: _param_order(o) for k, o in state.optimizers.items()}
    for lt in tensors:
        kind, key = lt.group.split(":", 1)
        w = lt.wrapper
        if w is not None and lt.tensor is vars(w.outer).get(w.attr):
            # the subclass's attribute holds this inner tensor (an inner tensor replaced
            # rather than written in place would leave the plan reading the old one)
            out.append((vars(w.outer), w.attr, lt.tensor))
        if kind == "model":
            mkey, mod = owners[lt.group]
            names = (lt.name, *lt.aliases) if w is None else \
                (w.record["of"], *(a.rpartition(".")[0] for a in lt.aliases))
            for full in names:
                path = full[len(mkey) + 1:]
                sub_name, _, leaf = path.rpartition(".")
                try:
                    sub = mod.get_submodule(sub_name) if sub_name else mod
                except AttributeError:
                    continue
                for d in (sub._parameters, sub._buffers):
                    if leaf in d:
                        out.append((d, leaf, lt.ident))
                        break
        elif lt.param_index is not None:
            opt = state.optimizers[key]
            p = params[key][lt.param_index]
            # Keyed by the tensor itself: looked up once here, never per boundary
            # (Tensor.__hash__ is a Python call). A whole new opt.state[p] dict is
            # found by the full re-scan; load_state_dict rebuilds the layout at once.
            st = opt.state.get(p)
            if st is not None:
                out.append((st, lt.state_key, lt.ident))
    return out


class Watch:
    """The identity entries (``identity_entries``) of one layout.

    ``attach`` hands them to the layout's native ``LayoutGuard``, whose
    ``boundary_check`` checks a rotating window of them per boundary (direct dict
    lookups, no Python loop).
    """

    def __init__(self, entries: list[IdentityEntry]) -> None:
        self.entries = entries

    def attach(self, guard: LayoutGuard) -> None:
        """Checks run in ``guard`` (a native LayoutGuard) from now on."""
        guard.set_entries(self.entries)
