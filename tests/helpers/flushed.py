"""A snapshot made for an export test: a few steps, a boundary after each, one flush."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from cudasnap.snapshotter import Snapshotter


def flushed_snapshot(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                     step_fn: Any, steps: int = 2, job: str = "texport") -> Path:
    """Trains ``steps`` steps (``step_fn()`` then the optimizer step) with a boundary after
    each, flushes and closes; the flushed step directory (the arena removed)."""
    snap = Snapshotter(model, opt, directory=directory, health=False, copy_threads=1,
                       job=f"{job}-{uuid.uuid4().hex[:8]}")
    try:
        for step in range(steps):
            step_fn()
            opt.step()
            opt.zero_grad(set_to_none=True)
            snap.boundary(step)
        path = snap.flush()
    finally:
        snap.close()
    assert not snap.arena_path.exists()
    return Path(path)
