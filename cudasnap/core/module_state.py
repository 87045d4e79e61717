"""Which tensors of a module a snapshot holds: the ones training writes.

A snapshot holds a module's parameters and persistent buffers, the objects the
optimizer steps and the forward updates, found by walking the module tree the way
``Module.state_dict`` does by default (each module's parameters, then its persistent
buffers, then its children), never by taking what ``state_dict()`` returns: a
``state_dict`` hook or a ``_save_to_state_dict`` override may return fresh tensors
built from the parameters (torchtitan's fused q/k/v split into ``wq``/``wk``/``wv``,
format converters, FSDP2's DTensor ops on a sharded parameter). A snapshot of such a
copy is taken once and never refreshed, and a restore into it never reaches the
parameter: a silently wrong resume (issue 32).

Names: a tensor's path in the module tree, less the attribute names of wrappers whose
own ``state_dict`` hook drops them (activation checkpointing, FSDP1): the ``state_dict``
key wherever ``state_dict`` returns the tensor itself, and ``layers.0.attention.wqkv``
where a hook splits it. cudasnap never calls ``state_dict()`` on the model: a hook may
make it a collective (torchtitan's hook all-gathers the sharded ``wqkv``), which one
rank, or a background thread, must never run alone.

``check`` refuses, naming the module, what cannot be restored bit for bit from the
parameters and buffers: a module keeping state in ``get_extra_state``, and a tensor that
a ``_save_to_state_dict`` override of a module owning no parameters or buffers emits
(packed weights held in a plain attribute). State dict hooks are taken for what they
are meant to be, functions of the parameters (logged at INFO).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from ..errors import ConfigError

log = logging.getLogger("cudasnap")

_BASE_SAVE = torch.nn.Module._save_to_state_dict
_BASE_EXTRA = torch.nn.Module.get_extra_state


def entries(mod: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(path, tensor, is buffer) of every parameter and persistent buffer of ``mod``, in
    the default ``state_dict`` order, repeats included (tied weights, a module reached
    twice), whatever hooks or overrides the modules have."""
    stack: list[tuple[str, torch.nn.Module]] = [("", mod)]
    while stack:
        prefix, m = stack.pop()
        for n, p in m._parameters.items():
            if p is not None:
                yield prefix + n, p, False
        nonp = m._non_persistent_buffers_set
        for n, b in m._buffers.items():
            if b is not None and n not in nonp:
                yield prefix + n, b, True
        kids = [(f"{prefix}{n}.", c) for n, c in m._modules.items() if c is not None]
        stack.extend(reversed(kids))


def custom(m: torch.nn.Module) -> bool:
    """Whether ``m``'s ``state_dict`` may differ from its parameters and buffers: a
    state_dict (post) hook, a ``_save_to_state_dict`` override or ``get_extra_state``. A
    pre-hook (FSDP2 registers one on every sharded module) sees no dict and changes none."""
    return bool(type(m)._save_to_state_dict is not _BASE_SAVE or m._state_dict_hooks
                or getattr(m, "_state_dict_post_hooks", None)
                or type(m).get_extra_state is not _BASE_EXTRA)


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    from . import sharded

    if type(t) not in (torch.Tensor, torch.nn.Parameter) and sharded.is_dtensor(t):
        t = sharded.local_shard(t)
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, ValueError):  # no storage (lazy, meta, ...)
        return None


def _emitted(m: torch.nn.Module) -> dict[str, object]:
    """What ``m``'s own ``_save_to_state_dict`` override emits (no hooks, no children)."""
    dest: dict[str, object] = {}
    m._save_to_state_dict(dest, "", True)
    return dest


def check(mkey: str, mod: torch.nn.Module) -> None:
    """ConfigError naming the module whose state a snapshot of its parameters and
    buffers would not restore (see the module docstring). Never calls ``state_dict()``:
    a hook may make it a collective (torchtitan's fused q/k/v hook all-gathers the
    sharded parameter), which no rank may run alone or off the training thread. State
    dict hooks are taken as what they are meant to be, functions of the parameters; a
    ``_save_to_state_dict`` override is called on its own module."""
    derived: list[str] = []
    for path, m in mod.named_modules(remove_duplicate=False):
        if not custom(m):
            continue
        where = f"{mkey}.{path}" if path else mkey
        if type(m).get_extra_state is not _BASE_EXTRA:
            raise ConfigError(
                f"module {where!r} ({type(m).__qualname__}) keeps state in get_extra_state(), "
                "outside its parameters and buffers: cudasnap snapshots parameters, buffers "
                "and optimizer state and cannot restore that state bit for bit; keep it in a "
                "buffer, or snapshot that module with torch.distributed.checkpoint")
        if type(m)._save_to_state_dict is _BASE_SAVE:
            if m._state_dict_hooks or getattr(m, "_state_dict_post_hooks", None):
                derived.append(where)
            continue
        own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        ids = {id(t) for t in own}
        storages = {_storage_key(t) for t in own} - {None}
        for key, v in _emitted(m).items():
            if not isinstance(v, torch.Tensor) or id(v) in ids or _storage_key(v) in storages:
                continue
            if not own:
                raise ConfigError(
                    f"{where}.{key} in the state_dict of model {mkey!r} is neither a parameter "
                    f"nor a buffer ({type(m).__qualname__}._save_to_state_dict makes it, and "
                    "the module has none, e.g. packed weights): cudasnap snapshots the tensors "
                    "training writes and cannot restore this one bit for bit; keep that state "
                    "in a parameter or buffer")
            derived.append(where)
    if derived:
        log.info("model %r: the state_dict of %d module(s) (%s%s) is made by hooks or overrides "
                 "from their parameters; cudasnap snapshots and restores the parameters "
                 "themselves", mkey, len(derived), ", ".join(derived[:4]),
                 ", ..." if len(derived) > 4 else "")


# Export views: module class -> fn(module) -> {parameter path relative to the module:
# {"kind": ..., "names": [the state_dict keys a hook makes of it, relative], ...}}.
# Registered by an integration (cudasnap.integrations.torchtitan: FusedQKVLinear); a DCP
# export writes those keys, computed from the parameter (cudasnap.tools.dcp_views).
ViewSpec = dict[str, object]  # {"kind": ..., "names": [...], ...} (JSON-like)
ViewProvider = Callable[[torch.nn.Module], dict[str, ViewSpec]]
VIEW_PROVIDERS: dict[type, ViewProvider] = {}


def register_views(cls: type, fn: ViewProvider) -> None:
    """Declares how ``cls``'s state_dict hook derives its keys from its parameters, in a
    form ``cudasnap export --to dcp`` can compute offline (a ``kind`` it knows)."""
    VIEW_PROVIDERS[cls] = fn


def views(mod: torch.nn.Module) -> list[tuple[str, str, ViewSpec]]:
    """(module path, parameter path relative to it, view spec) of the registered modules."""
    if not VIEW_PROVIDERS:
        return []
    out: list[tuple[str, str, ViewSpec]] = []
    for path, m in mod.named_modules():
        fn = VIEW_PROVIDERS.get(type(m))
        if fn is not None:
            out.extend((path, rel, spec) for rel, spec in fn(m).items())
    return out


def hooked(mod: torch.nn.Module) -> list[str]:
    """Paths of the modules whose ``state_dict`` keys or values are not their parameters'
    (a state_dict hook or ``_save_to_state_dict`` override), less the wrappers whose hook
    only drops their own attribute name and the modules with registered views: a DCP export
    holds the parameters, under their own names, which such a module's loader may not ask
    for."""
    return [p for p, m in mod.named_modules() if custom(m) and not _RENAMED & set(m._modules)
            and type(m) not in VIEW_PROVIDERS]


def live(mod: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is buffer) of the tensors a snapshot holds of ``mod``, repeats
    included: the path, less the attribute names of the wrappers whose state_dict hooks
    drop them from the keys (activation checkpointing, FSDP1), so a name is the
    ``state_dict`` key wherever ``state_dict`` returns the tensor itself."""
    if not any(a in _RENAMED for m in mod.modules() for a in m._modules):
        return list(entries(mod))
    return [(drop_renamed(path), t, buf) for path, t, buf in entries(mod)]


# Wrapper attributes that the wrapper's own state_dict hook drops from the keys.
_RENAMED = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def drop_renamed(path: str) -> str:
    """``path`` less the wrapper attribute names their own hooks drop (a tensor's name)."""
    return ".".join(a for a in path.split(".") if a not in _RENAMED)
