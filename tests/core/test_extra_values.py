"""Plain state beside model and optimizer: ``extra`` tensors/dicts/lists restored in place,
``boundary(step, **values)`` values back in ``snap.values``, immutable extras refused."""
from __future__ import annotations

import pytest
import torch

import cudasnap
from cudasnap.errors import ConfigError


def _job(snap_env, counters: dict, buf: torch.Tensor, hist: list):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, backend="cpu",
                                extra={"counters": counters, "buf": buf, "hist": hist})
    return model, opt, snap


def test_values_and_plain_extras_come_back(snap_env) -> None:
    counters, buf, hist = {"seen": 0}, torch.zeros(3), []
    model, opt, snap = _job(snap_env, counters, buf, hist)
    assert snap.restore_latest() == 0 and snap.values == {}
    X = None
    for step in range(3):
        X = torch.randn(2, 4)  # the prefetched next batch
        model(X).sum().backward()
        opt.step()
        opt.zero_grad()
        counters["seen"] += 1
        buf += step
        hist.append(step * 0.5)
        snap.boundary(step, X=X, best=1.5 - step, tag=f"s{step}")
    snap.flush()
    snap.close()
    c2, b2, h2 = {"seen": -1}, torch.full((3,), 9.0), ["junk"]
    _, _, snap2 = _job(snap_env, c2, b2, h2)
    assert snap2.restore_latest() == 3
    assert torch.equal(snap2.values["X"], X) and snap2.values["best"] == -0.5
    assert snap2.values["tag"] == "s2"
    assert c2 == {"seen": 3} and torch.equal(b2, buf) and h2 == [0.0, 0.5, 1.0]
    snap2.close()


def test_an_immutable_extra_is_refused_with_the_per_step_alternative(snap_env) -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"extra\['best'\] is an immutable float.*"
                                          r"snap\.boundary\(step, best=value\)"):
        cudasnap.Snapshotter(model, None, directory=snap_env.dir, backend="cpu",
                             extra={"best": 1.5})


def test_a_value_that_needs_pickle_is_refused_at_the_boundary(snap_env) -> None:
    model = torch.nn.Linear(4, 2)
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, backend="cpu")
    with pytest.raises(ConfigError, match="values.obj"):
        snap.boundary(0, obj=object())
    snap.close()
