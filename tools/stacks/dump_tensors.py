"""The stacks' final dumps: a state value as plain tensors ``torch.equal`` can compare."""
from __future__ import annotations

import torch


def plain_tensors(key: str, v: object) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` for a tensor or number; a tensor subclass (torchao's low-bit
    optimizer state) as its ``__tensor_flatten__`` inner tensors, ``{key.<attr>: tensor}``."""
    if isinstance(v, torch.Tensor) and type(v) not in (torch.Tensor, torch.nn.Parameter) and \
            hasattr(v, "__tensor_flatten__"):
        attrs, _ = v.__tensor_flatten__()
        return {f"{key}.{a}": getattr(v, a).detach().clone() for a in attrs}
    return {key: torch.as_tensor(v).detach().clone()}
