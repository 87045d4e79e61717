"""A restore leaves no gradients (issue 46): gradients are not snapshotted state, and a step
that failed half-way (a peer lost inside its all-reduce, an in-process restart) or a NaN
loss's backward (a rollback) left some; the next backward would add to them, and the resumed
run would differ from one that never failed."""
from __future__ import annotations

import uuid
from pathlib import Path

import torch

from cudasnap.snapshotter import Snapshotter


def _step(m: torch.nn.Module, o: torch.optim.Optimizer, i: int, finish: bool = True) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
    m(x).square().mean().backward()
    if finish:
        o.step()
        o.zero_grad(set_to_none=True)


def _run(tmp: Path, fail: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 4)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    snap = Snapshotter(m, o, directory=tmp, health=False, copy_threads=1,
                       job=f"grads-{uuid.uuid4().hex[:8]}")
    try:
        for i in range(3):
            _step(m, o, i)
            snap.boundary(i)
        snap.wait()
        if fail:
            _step(m, o, 3, finish=False)  # backward done, the step never came
            assert m.weight.grad is not None
            assert snap.rollback() == 3
            assert m.weight.grad is None and m.bias.grad is None
        for i in range(3, 6):
            _step(m, o, i)
    finally:
        snap.close(keep_arena=False)
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_a_rollback_after_a_half_step_resumes_as_a_run_that_never_failed(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", fail=False)
    b = _run(tmp_path / "b", fail=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
