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
from . import sharded

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

    @property
    def ident(self) -> torch.Tensor:
        """The object its container (module, optimizer state) holds."""
        return self.tensor if self.owner is None else self.owner

    @property
    def nbytes(self) -> int:
        """Bytes from the first element to one past the last (``span_bytes``); a
        contiguous tensor's ``nbytes`` without the Python loop (its span, 0 when empty)."""
        t = self.tensor
        if t.is_contiguous():
            return int(t.nbytes)
        return span_bytes(list(t.shape), list(t.stride()), t.element_size())


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
        check_plain_tensor(name, t)
    if dtype_key(t.dtype) is None:
        raise ConfigError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}, which "
                          f"snapshots do not hold (supported: {', '.join(dtype_names())}); "
                          "convert it, or keep it out of the snapshotted state")


def check_plain_tensor(name: str, t: torch.Tensor) -> None:
    """ConfigError for a tensor whose bytes cudasnap cannot read as raw memory.

    A wrapper subclass (DTensor from FSDP2 / tensor parallel, quantized or other
    ``__torch_dispatch__`` tensors) has no storage of its own: its ``data_ptr``
    is not its data, and copying from it would read unrelated memory.
    """
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return
    if sharded.is_dtensor(t):  # its local shard is copied instead (cudasnap.core.sharded)
        check_tensor(f"{name} (local shard)", sharded.local_shard(t))
        return
    if getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__ or \
            hasattr(t, "__tensor_flatten__"):
        raise ConfigError(
            f"{name} is a {cls.__module__}.{cls.__qualname__}, a tensor subclass whose bytes do "
            "not live in its own storage (sharded DTensor state of FSDP2 / tensor parallelism, "
            "or another __torch_dispatch__ wrapper); cudasnap cannot snapshot it yet: snapshot "
            "plain tensors only (e.g. the unsharded model), or use torch.distributed.checkpoint "
            "for sharded state")

