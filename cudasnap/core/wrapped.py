"""Tensor subclasses whose bytes live in inner tensors: snapshotted as those, rebuilt at restore.

A traceable wrapper subclass (torchao's low-bit optimizer state ``OptimState8bit``,
``OptimState4bit``, ``OptimStateFp8``; any subclass torch.compile can trace) says what it is
made of: ``t.__tensor_flatten__()`` gives the names of its inner tensor attributes and a
context (e.g. ``[signed, dtype]``), and ``cls.__tensor_unflatten__(inner, ctx, size,
stride)`` makes it again. Its own ``data_ptr`` is not its data; its inner tensors are
plain tensors with storage of their own, which the copy engine copies like any other.

A snapshot holds each inner tensor as an entry of its own, named ``<name>.<attr>`` (e.g.
``optim.state.3.exp_avg.codes``), carrying the subclass's record::

    "wrapper": {"of": "optim.state.3.exp_avg", "attr": "codes",
                "class": "torchao.optim.subclass_8bit:OptimState8bit",
                "ctx": <codec JSON of the context>, "inner": ["codes", "scale", "qmap"],
                "shape": [64, 128], "stride": [128, 1], "dtype": "float32"}

(``shape``/``stride``/``dtype``: the subclass's own, which may differ from its inner
tensors'). A restore copies the bytes into the live subclass's inner tensors when the
live value is of the same class and context (rollback, a warm optimizer), else rebuilds
it with ``__tensor_unflatten__`` from new inner tensors (a fresh optimizer, whose state
torchao creates only at its first step). The class is looked up among the modules the
process imported (the training script built the optimizer, so torchao's module is
there), never imported by a name read from a file.

The context is recorded when the layout is built (it is constant for torchao's state: its
sign, dtype and shape); one that JSON cannot hold is refused naming its type. A subclass
nested in a subclass, or one without ``__tensor_unflatten__``, is refused with the reason.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, IncompatibleSnapshot
from ..format import codec
from . import sharded

# The manifest's "wrapper" record of one inner tensor (see the module doc).
Record = dict[str, Any]


@dataclass
class Wrapped:
    """An inner tensor's place in its subclass (``LiveTensor.wrapper``)."""

    outer: torch.Tensor  # the subclass object (a DTensor's local shard, under FSDP2)
    attr: str
    record: Record
    first: bool  # the first inner tensor of its subclass (the identity re-scan counts it once)


def is_wrapper(t: object) -> bool:
    """True for a tensor subclass whose bytes are its ``__tensor_flatten__`` inner tensors
    (not DTensor, which cudasnap.core.sharded handles: its local shard is the data)."""
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return False
    if sharded.is_dtensor(t):
        return False
    return callable(getattr(cls, "__tensor_flatten__", None)) and \
        callable(getattr(cls, "__tensor_unflatten__", None))


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _flatten(name: str, t: torch.Tensor) -> tuple[list[str], object]:
    try:
        attrs, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - a subclass's own code: any failure is the reason
        raise ConfigError(f"{name}: its {class_path(type(t))}.__tensor_flatten__() failed: "
                          f"{type(e).__name__}: {e}") from e
    if not isinstance(attrs, (list, tuple)) or not attrs or \
            not all(isinstance(a, str) for a in attrs):
        raise ConfigError(f"{name}: {class_path(type(t))}.__tensor_flatten__() gave inner "
                          f"tensor names {attrs!r}; cudasnap needs a non-empty list of names")
    return list(attrs), ctx


def record_of(name: str, t: torch.Tensor) -> tuple[Record, list[torch.Tensor]]:
    """The record of subclass ``t`` (state named ``name``) and its inner tensors in the
    record's order; ConfigError naming the reason when cudasnap cannot snapshot it."""
    attrs, ctx = _flatten(name, t)
    try:
        ctx_json = codec.encode(ctx, f"{name} (its __tensor_flatten__ context)")
    except ConfigError as e:
        raise ConfigError(f"{name} is a {class_path(type(t))} whose __tensor_flatten__ context "
                          f"cannot be recorded without pickle: {e}") from e
    inner = []
    held = vars(t)
    for a in attrs:
        v = getattr(t, a, None)
        if isinstance(v, torch.Tensor) and held.get(a) is not v:
            raise ConfigError(
                f"{name}: {class_path(type(t))} holds its inner tensor {a!r} outside its "
                "instance __dict__ (a property or __slots__): cudasnap could not see it "
                "replaced by another tensor, and would copy the old one; keep it an attribute")
        if not isinstance(v, torch.Tensor):
            raise ConfigError(f"{name}: {class_path(type(t))}.__tensor_flatten__() names "
                              f"{a!r}, which is not a tensor attribute ({type(v).__name__})")
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise ConfigError(
                f"{name}.{a} is a {class_path(type(v))} inside a {class_path(type(t))}: "
                "cudasnap snapshots one level of tensor subclass (plain inner tensors); a "
                "subclass nested in another is not supported")
        inner.append(v)
    rec: Record = {"of": name, "class": class_path(type(t)), "ctx": ctx_json, "inner": attrs,
                   "shape": [int(s) for s in t.shape], "stride": [int(s) for s in t.stride()],
                   "dtype": str(t.dtype).removeprefix("torch.")}
    return rec, inner


def find_class(rec: Record, where: str, load: bool = False) -> type:
    """The subclass a record names, from the modules this process imported. A restore never
    imports a module by a name read from a snapshot; ``load`` (an export the user asked
    for, of a directory whose owner it checked) imports the installed module."""
    path = rec.get("class")
    mod_name, _, qual = path.partition(":") if isinstance(path, str) else ("", "", "")
    mod = sys.modules.get(mod_name)
    if mod is None and load and mod_name.replace(".", "").replace("_", "").isalnum():
        import importlib

        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise IncompatibleSnapshot(
                f"{where}: {rec.get('of')!r} is a {path}, whose module cannot be imported here "
                f"({e}); install the package that defines it (e.g. torchao)") from e
    obj: Any = mod
    for part in qual.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if not (isinstance(obj, type) and issubclass(obj, torch.Tensor)
            and callable(getattr(obj, "__tensor_unflatten__", None))):
        raise IncompatibleSnapshot(
            f"{where}: {rec.get('of')!r} is a {path} in the snapshot, a tensor subclass this "
            f"process has not imported (module {mod_name!r}); import it (build the optimizer "
            "or model that uses it) before restoring")
    return obj


def same_kind(live: object, rec: Record) -> bool:
    """Whether live value ``live`` is the recorded subclass with the same context, shape
    and inner tensor names (its inner tensors can take the snapshot's bytes in place)."""
    if not is_wrapper(live) or class_path(type(live)) != rec.get("class"):
        return False
    assert isinstance(live, torch.Tensor)
    try:
        attrs, ctx = _flatten(str(rec.get("of")), live)
        return attrs == rec.get("inner") and codec.encode(ctx) == rec.get("ctx") and \
            [int(s) for s in live.shape] == rec.get("shape")
    except ConfigError:
        return False


def rebuild(rec: Record, inner: dict[str, torch.Tensor], where: str,
            load: bool = False) -> torch.Tensor:
    """The subclass a record describes, made by its ``__tensor_unflatten__`` around
    ``inner`` (its inner tensors by name); ``load``: see ``find_class``."""
    cls = find_class(rec, where, load)
    ctx = codec.decode(rec.get("ctx"), f"{rec.get('of')} context")
    try:
        out = cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            inner, ctx, torch.Size(rec["shape"]), tuple(rec["stride"]))
    except Exception as e:  # noqa: BLE001 - a subclass's own code
        raise IncompatibleSnapshot(f"{where}: {rec.get('of')!r} could not be rebuilt as a "
                                   f"{rec.get('class')}: {type(e).__name__}: {e}") from e
    if not isinstance(out, torch.Tensor):
        raise IncompatibleSnapshot(f"{where}: {rec.get('class')}.__tensor_unflatten__ gave a "
                                   f"{type(out).__name__}, not a tensor")
    return out
