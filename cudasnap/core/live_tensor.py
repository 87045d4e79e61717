"""A live tensor of the snapshotted state, and which tensors can be snapshotted.

``LiveTensor`` is one tensor ``TrainingState.live_tensors()`` lists (by name, group and
phase, without copying); ``check_tensor`` / ``check_plain_tensor`` refuse what the copy
engine cannot read as raw memory; ``single_cuda_device`` finds the one CUDA device the
state lives on; ``_param_order`` is an optimizer's parameter order, which optimizer state
entries index. The checks read metadata only, where the layout is built, never per
boundary.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from ..errors import ConfigError
from ..format import codec
from ..format.manifest import dtype_key, dtype_names, span_bytes
from . import sharded, wrapped

if TYPE_CHECKING:  # type-only: torch.distributed.tensor is imported once a DTensor exists
    from torch.distributed.tensor import DTensor

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Lazy modules' parameters and buffers before their first forward (no shape yet).
_UNINITIALIZED = (torch.nn.UninitializedParameter, torch.nn.UninitializedBuffer)


@dataclass
class LiveTensor:
    name: str
    group: str  # "model:<key>" or "optim:<key>"
    tensor: torch.Tensor
    phase: int  # 0: module buffer (fenced at forward), 1: parameter / optimizer state
    param_index: int | None = None  # optimizer state: index in the optimizer's param order
    state_key: str | None = None
    aliases: list[str] = field(default_factory=list)
    # Sharded state (cudasnap.core.sharded): ``tensor`` is the local shard of ``owner``.
    owner: DTensor | None = None
    shard: sharded.ShardInfo | None = None
    # An inner tensor of a tensor subclass (cudasnap.core.wrapped): ``tensor`` is one of
    # the bytes-holding tensors of ``wrapper.outer``.
    wrapper: wrapped.Wrapped | None = None

    @property
    def ident(self) -> torch.Tensor:
        """The object its container (module, optimizer state) holds."""
        if self.owner is not None:
            return self.owner
        return self.tensor if self.wrapper is None else self.wrapper.outer

    @property
    def nbytes(self) -> int:
        """Bytes from the first element to one past the last (``span_bytes``); a
        contiguous tensor's ``nbytes`` without the Python loop (its span, 0 when empty)."""
        t = self.tensor
        if t.is_contiguous():
            return int(t.nbytes)
        return span_bytes(list(t.shape), list(t.stride()), t.element_size())


def expand_wrapper(lt: LiveTensor) -> list[LiveTensor]:
    """The LiveTensors of the inner tensors of ``lt`` (a wrapper subclass, or a DTensor
    whose local shard is one): same group, phase, optimizer slot, owner and shard record;
    named ``<name>.<attr>``."""
    outer = lt.tensor
    rec, inner = wrapped.record_of(lt.name, outer)
    out = []
    for i, (a, v) in enumerate(zip(rec["inner"], inner)):
        out.append(LiveTensor(f"{lt.name}.{a}", lt.group, v, lt.phase, lt.param_index,
                              lt.state_key, [f"{al}.{a}" for al in lt.aliases], lt.owner,
                              lt.shard, wrapped.Wrapped(outer, a, {**rec, "attr": a}, i == 0)))
    return out


def single_cuda_device(tensors: Iterable[LiveTensor | torch.Tensor],
                       expect: int | None = None) -> torch.device:
    """The one CUDA device the state lives on; ConfigError naming the devices when
    it spans several (one Snapshotter copies from one device: its plan offsets
    would assume tensors the device's engine cannot read).

    ``tensors``: LiveTensor-like objects (``.name``, ``.tensor``) or tensors.
    ``expect``: the device index the engine was created for.
    """
    first: dict[int, str] = {}
    for i, it in enumerate(tensors):
        t = cast("torch.Tensor", getattr(it, "tensor", it))
        if not getattr(t, "is_cuda", False):
            continue
        idx = t.device.index if t.device.index is not None else -1
        first.setdefault(idx, getattr(it, "name", f"tensor {i}"))
    if expect is not None:
        first.setdefault(expect, "the copy engine")
    if not first:
        raise ConfigError("the CUDA backend needs state on a CUDA device; none is")
    if len(first) > 1:
        where = ", ".join(f"cuda:{d} ({n})" for d, n in sorted(first.items()))
        raise ConfigError(
            f"state lives on more than one CUDA device: {where}; one Snapshotter snapshots "
            "one device: move the state to one device, or use one process (and "
            "Snapshotter) per device")
    idx = next(iter(first))
    return torch.device("cuda", idx) if idx >= 0 else torch.device("cuda")


def _param_order(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def check_tensor(name: str, t: torch.Tensor) -> None:
    """ConfigError naming state tensor ``name`` when the copy engine cannot snapshot it:
    a NestedTensor, a tensor without data (meta device: copying its null pointer
    crashed the copy workers) or on a device other than CPU/CUDA, a sparse layout, a
    wrapper subclass (``check_plain_tensor``) or a dtype snapshots do not hold.
    Metadata only: run where the layout is built (construction, plan rebuild), never
    per boundary."""
    plain = type(t) in _PLAIN
    if not plain and isinstance(t, _UNINITIALIZED):
        raise ConfigError(f"{name} is an uninitialized lazy parameter or buffer (it has no "
                          "shape yet): run one forward pass before creating the Snapshotter")
    if t.is_nested or not (t.is_cpu or t.is_cuda) or t.layout != torch.strided:  # fast path
        why = codec.odd_tensor(t)
        if why is not None:
            raise ConfigError(f"{name} {why}")
    if not plain:
        if check_plain_tensor(name, t):
            return  # a wrapper subclass: its inner tensors are checked (expand_wrapper)
    if dtype_key(t.dtype) is None:
        raise ConfigError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}, which "
                          f"snapshots do not hold (supported: {', '.join(dtype_names())}); "
                          "convert it, or keep it out of the snapshotted state")


def check_plain_tensor(name: str, t: torch.Tensor) -> bool:
    """ConfigError for a tensor whose bytes cudasnap cannot read as raw memory; True for a
    wrapper subclass whose inner tensors hold its bytes (cudasnap.core.wrapped: they are
    snapshotted instead, and checked as the layout lists them), directly or as a DTensor's
    local shard (torchao's low-bit optimizer state under FSDP2).

    A DTensor (FSDP2 / tensor parallel) has no storage of its own: its local shard is
    copied (cudasnap.core.sharded). Another ``__torch_dispatch__`` subclass without
    ``__tensor_flatten__``/``__tensor_unflatten__`` says nowhere where its bytes are.
    """
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    if sharded.is_dtensor(t):  # its local shard is copied instead (cudasnap.core.sharded)
        local = sharded.local_shard(t)
        if wrapped.is_wrapper(local):
            return True
        check_tensor(f"{name} (local shard)", local)
        return False
    if wrapped.is_wrapper(t):
        return True
    if getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__ or \
            hasattr(t, "__tensor_flatten__"):
        raise ConfigError(
            f"{name} is a {cls.__module__}.{cls.__qualname__}, a __torch_dispatch__ tensor "
            "subclass without __tensor_flatten__/__tensor_unflatten__: its bytes do not live in "
            "its own storage and it does not say which tensors hold them, so cudasnap cannot "
            "snapshot it; keep its plain inner tensors in the state instead (or implement the "
            "two methods, as torch.compile-traceable subclasses such as torchao's do)")
    return False
