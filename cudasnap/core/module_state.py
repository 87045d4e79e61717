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

Names: a tensor's name is its ``state_dict`` key where ``state_dict`` returns that very
object (so hooks that only rename, e.g. activation checkpointing's, keep the names
``get_state_dict`` uses), else its path in the module tree (``layers.0.attention.wqkv``).

``check`` refuses, naming the module, what cannot be restored bit for bit from the
parameters and buffers: a module keeping state in ``get_extra_state``, and a
``state_dict`` entry that is neither a parameter or buffer, a view of one, nor made by a
hook or override of a module that owns parameters or buffers (e.g. packed weights held
in a plain attribute).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError

log = logging.getLogger("cudasnap")

# Wrapper modules whose attribute name state_dict-renaming hooks leave out of a key
# (torch.compile, activation checkpointing, FSDP1).
WRAPPER_ATOMS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
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
    state_dict hook, a ``_save_to_state_dict`` override or ``get_extra_state``."""
    return bool(type(m)._save_to_state_dict is not _BASE_SAVE or m._state_dict_hooks
                or m._state_dict_pre_hooks or getattr(m, "_state_dict_post_hooks", None)
                or type(m).get_extra_state is not _BASE_EXTRA)


def any_custom(mod: torch.nn.Module) -> bool:
    return any(custom(m) for m in mod.modules())


def _clean(path: str) -> str:
    return ".".join(a for a in path.split(".") if a and a not in WRAPPER_ATOMS)


def _storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    from . import sharded

    if type(t) not in (torch.Tensor, torch.nn.Parameter) and sharded.is_dtensor(t):
        t = sharded.local_shard(t)
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, ValueError):  # no storage (lazy, meta, ...)
        return None


def names(mod: torch.nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> its state_dict keys`` (in order; a tied tensor has several) for the
    parameters and buffers ``state_dict`` returns as themselves (only needed for a model
    with a custom module: for the others every key is the tensor's path)."""
    out: dict[int, list[str]] = {}
    for key, v in mod.state_dict(keep_vars=True).items():
        if isinstance(v, torch.Tensor):
            out.setdefault(id(v), []).append(key)
    return out


def check(mkey: str, mod: torch.nn.Module) -> None:
    """ConfigError naming the module whose state a snapshot of its parameters and
    buffers would not restore (see the module docstring). Metadata and one
    ``state_dict()``; only does work for a model with a custom module."""
    customs = [(p, m) for p, m in mod.named_modules(remove_duplicate=False) if custom(m)]
    if not customs:
        return
    for path, m in customs:
        if type(m).get_extra_state is not _BASE_EXTRA:
            where = f"{mkey}.{path}" if path else mkey
            raise ConfigError(
                f"module {where!r} ({type(m).__qualname__}) keeps state in get_extra_state(), "
                "outside its parameters and buffers: cudasnap snapshots parameters, buffers "
                "and optimizer state and cannot restore that state bit for bit; keep it in a "
                "buffer, or snapshot that module with torch.distributed.checkpoint")
    walked = {id(t) for _, t, _ in entries(mod)}
    storages = {_storage_key(t) for _, t, _ in entries(mod)} - {None}
    owners = [(_clean(p), m) for p, m in customs
              if any(True for _ in entries(m))]  # hooks of modules that hold tensors
    derived: list[str] = []
    for key, v in mod.state_dict(keep_vars=True).items():
        if not isinstance(v, torch.Tensor) or id(v) in walked:
            continue
        if _storage_key(v) in storages:
            continue  # a view of a parameter or buffer: restored through it
        ck = _clean(key)
        if any(not p or ck == p or ck.startswith(p + ".") for p, _ in owners):
            derived.append(key)
            continue
        raise ConfigError(
            f"{mkey}.{key} in the state_dict of model {mkey!r} is neither a parameter nor a "
            "buffer of it (a state_dict hook or _save_to_state_dict override of a module with "
            "no parameters or buffers made it, e.g. packed weights): cudasnap snapshots the "
            "tensors training writes and cannot restore this one bit for bit; keep that state "
            "in a parameter or buffer")
    if derived:
        log.info("model %r: %d state_dict entr%s (%s%s) are made by hooks from the parameters; "
                 "cudasnap snapshots and restores the parameters themselves", mkey, len(derived),
                 "y" if len(derived) == 1 else "ies", ", ".join(derived[:4]),
                 ", ..." if len(derived) > 4 else "")


def live(mod: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is buffer) of the tensors a snapshot holds of ``mod``, repeats
    included, named as the module docstring says."""
    if not any_custom(mod):
        return list(entries(mod))
    keys = names(mod)
    out = []
    for path, t, buf in entries(mod):
        left = keys.get(id(t))
        out.append((left.pop(0) if left else path, t, buf))
    return out
