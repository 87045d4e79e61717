"""Optimizers that wrap other optimizers, and optimizers that hold no state.

Training stacks hand the user an object that *is* a ``torch.optim.Optimizer`` (or looks
like one) but owns no state and steps inner optimizers: torchtitan's
``OptimizersContainer`` (a list ``optimizers``, one per model part), HF accelerate's
``AcceleratedOptimizer`` (``optimizer``, whose ``state`` it forwards), Lightning's
``LightningOptimizer`` (``_optimizer``). A snapshot of the wrapper would hold its empty
``state``: the resume silently loses Adam's moments (issue 32).

``flatten`` replaces each wrapper by the optimizers it wraps (found in its attributes: an
optimizer, or a list, tuple or dict of them; wrappers of wrappers too): one inner optimizer
keeps the wrapper's key, several are ``<key>.<i>`` in their order. The wrappers are kept
(``Wrapped``) so that ``check_wrappers`` can refuse one that later holds state of its own
(``state`` neither empty nor an inner optimizer's): that state would not be in the
snapshot.

``check_stepped`` runs once, after an optimizer's first step: an optimizer with gradients
that still holds no state is a wrapper cudasnap could not see into (ConfigError naming it
and what to pass), unless it is known to keep none (``SGD`` without momentum, or marked
``cudasnap_stateless = True`` by its owner).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch

from ..errors import ConfigError

Optimizer = torch.optim.Optimizer


def _inner(obj: object) -> list[Optimizer]:
    """The optimizers ``obj`` holds in its attributes (an optimizer; a list, tuple or dict
    of them), in attribute order."""
    found: list[Optimizer] = []
    try:
        attrs = vars(obj)
    except TypeError:
        return found
    for v in attrs.values():
        if v is obj:
            continue
        if isinstance(v, Optimizer):
            found.append(v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, Optimizer) for x in v):
            found.extend(v)
        elif isinstance(v, dict) and v and all(isinstance(x, Optimizer) for x in v.values()):
            found.extend(v.values())
    return found


def is_optimizer_like(obj: object) -> bool:
    """An optimizer, or a wrapper object (not an Optimizer) holding optimizers."""
    return isinstance(obj, Optimizer) or bool(_inner(obj))


@dataclass
class Wrapped:
    key: str
    wrapper: object
    inner: list[Optimizer]


def flatten(optimizers: Mapping[str, object]) -> tuple[dict[str, Optimizer], list[Wrapped]]:
    """(the optimizers to snapshot by key, the wrappers they came from); see the module
    docstring."""
    out: dict[str, Optimizer] = {}
    wrapped: list[Wrapped] = []

    def leaves(obj: object, depth: int) -> list[Optimizer]:
        inner = _inner(obj)
        if not inner or depth > 8:  # an optimizer (is_optimizer_like), or nested too deep
            return [cast(Optimizer, obj)]
        return [leaf for o in inner for leaf in leaves(o, depth + 1)]

    for key, obj in optimizers.items():
        inner = leaves(obj, 0)
        if inner == [obj]:
            out[key] = cast(Optimizer, obj)
            continue
        wrapped.append(Wrapped(key, obj, inner))
        if len(inner) == 1:
            out[key] = inner[0]
        else:
            out.update((f"{key}.{i}", o) for i, o in enumerate(inner))
    seen: dict[int, str] = {}
    for key, opt in out.items():
        if id(opt) in seen:
            raise ConfigError(f"optimizer {key!r} and {seen[id(opt)]!r} are one optimizer "
                              "(a wrapper and what it wraps?): pass it once")
        seen[id(opt)] = key
    return out, wrapped


def check_wrappers(wrapped: list[Wrapped]) -> None:
    """ConfigError when a wrapper holds optimizer state of its own (not in the snapshot)."""
    for w in wrapped:
        st = getattr(w.wrapper, "state", None)
        if not st or any(st is getattr(o, "state", None) for o in w.inner):
            continue
        raise ConfigError(
            f"optimizer {w.key!r} ({type(w.wrapper).__qualname__}) wraps {len(w.inner)} "
            "optimizer(s) and also holds state of its own, which cudasnap would not snapshot; "
            "pass the optimizers whose state it holds explicitly, as a dict")


def _stateless(opt: Optimizer) -> bool:
    if getattr(opt, "cudasnap_stateless", False):
        return True
    return type(opt) is torch.optim.SGD and all(not g.get("momentum") for g in opt.param_groups)


def check_stepped(key: str, opt: Optimizer) -> None:
    """After ``opt``'s first step: ConfigError when it has parameters with gradients and
    still holds no state (see the module docstring)."""
    if opt.state or _stateless(opt):
        return
    if not any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return
    raise ConfigError(
        f"optimizer {key!r} ({type(opt).__module__}.{type(opt).__qualname__}) holds no state "
        "after its step although its parameters have gradients: it looks like a container "
        "stepping other optimizers that cudasnap cannot find, and a snapshot of it would "
        "lose their state (e.g. Adam's moments). Pass the inner optimizers, e.g. "
        "optimizer={'a': inner_a, 'b': inner_b}; if it really keeps no state, set "
        "its attribute cudasnap_stateless = True")
