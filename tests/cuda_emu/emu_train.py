"""A training job whose every write of the GPU state is a host-to-device copy.

Under the emulated CUDA runtime kernels do not run, so the "forward" writes its
buffer and the "optimizer" writes parameters and moments with ``copy_`` from
host tensors derived from (tensor, step): each step changes every byte, on the
current stream, exactly where a real forward / optimizer step would. The
Snapshotter's fences (optimizer step pre-hook, forward pre-hook of modules with
buffers) must order these writes after the running snapshot copy.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def pattern(shape: tuple[int, ...], key: int, step: int) -> torch.Tensor:
    """A float32 host tensor unique to (key, step) in every element."""
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64)
    return (base * 1e-3 + key * 1000.0 + step).to(torch.float32).reshape(shape)


class Net(nn.Module):
    """Parameters, a buffer the forward writes (as BatchNorm's running stats), a tied view."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.w = nn.Parameter(pattern((256, 256), 1, seed))
        self.b = nn.Parameter(pattern((4096,), 2, seed))
        self.register_buffer("stat", pattern((1024,), 3, seed))
        self.forwards = 0

    def forward(self, step: int) -> None:
        self.forwards += 1
        with torch.no_grad():
            self.stat.copy_(pattern(tuple(self.stat.shape), 3, step))


class CopyOptimizer(torch.optim.Optimizer):
    """Writes each parameter and its moment from host values; its state appears lazily
    (at the first step), as Adam's does. ``n`` is host state (like Adam's ``step``)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            for i, p in enumerate(g["params"]):
                st = self.state[p]
                n = int(st.get("n", 0)) + 1
                if "m" not in st:
                    st["m"] = torch.empty_like(p)  # no zeros_like: a fill kernel would not run
                st["n"] = n
                p.copy_(pattern(tuple(p.shape), 10 + i, n))
                st["m"].copy_(pattern(tuple(p.shape), 20 + i, n))


def build(seed: int = 0, device: str = "cuda") -> tuple[Net, CopyOptimizer]:
    model = Net(seed).to(device)
    return model, CopyOptimizer(model.parameters())


def train_step(model: Net, opt: CopyOptimizer, step: int) -> None:
    model(step)
    opt.step()


def state_bytes(snap: Any) -> dict[str, torch.Tensor]:
    """name -> synchronous host copy (raw bytes) of every tensor the Snapshotter snapshots."""
    out = {}
    for lt in snap.state.live_tensors():
        t = lt.tensor.detach()
        out[lt.name] = t.cpu().contiguous().reshape(-1).view(torch.uint8).clone()
    return out


def diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    bad += [k for k in sorted(set(got) & set(want)) if not torch.equal(got[k], want[k])]
    return bad
