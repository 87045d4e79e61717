"""A small, fully deterministic training job for the end-to-end tests.

Everything that decides the next step lives in what cudasnap snapshots: model
parameters and BatchNorm buffers, AdamW state, a StepLR scheduler and a
data-position object (``extra``), and the torch / numpy / Python RNG streams
(dropout, input noise, a loss scale). A resumed run is bitwise equal to an
uninterrupted one only if every piece of that state comes back exactly.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

SEED = 1234


class DataPosition:
    """Where the 'loader' is: the next batch index (plus a derived epoch)."""

    def __init__(self, n_batches: int) -> None:
        self.pos = 0
        self.n_batches = n_batches

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "epoch": self.pos // self.n_batches}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.pos = int(d["pos"])


class Job:
    def __init__(self, dim: int = 32, batch: int = 8, n_data: int = 64) -> None:
        torch.manual_seed(SEED)
        random.seed(SEED)
        np.random.seed(SEED)
        self.dim, self.batch = dim, batch
        self.model = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
                                   nn.Dropout(0.2), nn.Linear(dim, dim))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.05)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.data = DataPosition(n_data // batch)
        g = torch.Generator().manual_seed(SEED + 1)
        self.dataset = torch.randn(n_data, dim, generator=g)
        self.model.train()

    def extra(self) -> dict[str, Any]:
        return {"sched": self.sched, "data": self.data}

    def step(self) -> None:
        i = self.data.pos % self.data.n_batches
        x = self.dataset[i * self.batch:(i + 1) * self.batch]
        noise = np.random.standard_normal(x.shape).astype(np.float32)
        x = x + 0.05 * torch.from_numpy(noise)
        scale = 1.0 + random.random()
        loss = (self.model(x) - x).pow(2).mean() * scale
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.data.pos += 1

    # ------------------------------------------------------------ inspection
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state, by a stable name."""
        out = {f"model.{k}": v.detach() for k, v in self.model.state_dict().items()}
        params = [p for g in self.opt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for k, v in self.opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"opt.{i}.{k}"] = v.detach()
        out["rng.torch"] = torch.get_rng_state()
        return out

    def host_state(self) -> dict[str, Any]:
        """The non-tensor state, as comparable plain values."""
        ns = np.random.get_state()
        return {
            "lr": [g["lr"] for g in self.opt.param_groups],
            "sched": {k: v for k, v in self.sched.state_dict().items()},
            "data": self.data.state_dict(),
            "rng.numpy": [ns[0], int(np.asarray(ns[1]).sum()), ns[2], ns[3], ns[4]],
            "rng.numpy.crc": _crc(torch.from_numpy(np.asarray(ns[1]).copy())),
            # (not hash(getstate()): hash(None) is address-based before Python 3.12)
            "rng.python": [_crc(torch.tensor(random.getstate()[1], dtype=torch.int64)),
                           repr(random.getstate()[2])],
        }

    def digests(self) -> dict[str, Any]:
        """Per-tensor CRC32C + the host state: compact enough to compare step by step."""
        d: dict[str, Any] = {k: _crc(v) for k, v in self.tensors().items()}
        d.update({k: repr(v) for k, v in self.host_state().items()})
        return d

    def arrays(self) -> dict[str, np.ndarray]:
        """Full final state as numpy arrays (saved with np.savez: no pickle)."""
        out = {k: v.reshape(-1).contiguous().view(torch.uint8).numpy().copy()
               for k, v in self.tensors().items()}
        for k, v in self.host_state().items():
            out["host." + k] = np.frombuffer(repr(v).encode(), np.uint8).copy()
        # The RNG streams must continue identically: draw from each.
        out["draw.torch"] = torch.rand(16).numpy()
        out["draw.numpy"] = np.random.rand(16)
        out["draw.python"] = np.array([random.random() for _ in range(16)])
        return out


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: Any, steps: int,
          start: int = 0) -> None:
    """``steps`` optimizer steps of a Sequential starting with a Linear, a boundary after each,
    then waits for the last snapshot (the CLI and S3 tests' small training loop)."""
    for step in range(start, start + steps):
        model(torch.randn(8, model[0].in_features)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snap.boundary(step)
    snap.wait()


def _crc(t: torch.Tensor) -> str:
    from cudasnap._native import native

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{native().crc32c(raw):08x}:{raw.size}"


def small_adam(dim: int = 64, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear + BatchNorm under Adam: a tiny state with parameters, buffers and Adam moments."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def adam_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One training step of ``small_adam``'s model on random input."""
    model(torch.randn(8, model[0].in_features)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
