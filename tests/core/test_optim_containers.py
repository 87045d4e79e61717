"""Optimizer wrappers (issue 32): a container stepping inner optimizers (torchtitan's
``OptimizersContainer``: an Optimizer subclass holding ``optimizers``, with no state of its
own), accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` are
snapshotted through the optimizers they hold, bit for bit; a wrapper cudasnap cannot see
into is refused at its first step, naming what to pass."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import cudasnap
from cudasnap.core.state import TrainingState
from cudasnap.errors import ConfigError


class Container(torch.optim.Optimizer):
    """torchtitan 0.3.0's OptimizersContainer, reduced: one AdamW per model part, the
    container initialised over all parameters (its own param_groups, empty state), step()
    steps each inner optimizer."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
        torch.optim.Optimizer.__init__(self, [q for p in parts for q in p.parameters()],
                                       {"lr": 1e-2})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class Hidden(torch.optim.Optimizer):
    """A wrapper whose inner optimizer cudasnap cannot find (held in a closure)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        inner = torch.optim.AdamW(params, lr=1e-2)
        self._step = inner.step
        torch.optim.Optimizer.__init__(self, params, {"lr": 1e-2})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self._step()


def _parts() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(6, 6), "b": torch.nn.Linear(6, 2)})


def _train(model: torch.nn.ModuleDict, opt: Any, steps: range, snap: Any = None) -> None:
    for step in steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model["b"](torch.tanh(model["a"](x))).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if snap is not None:
            snap.boundary(step)


def _state(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for o in opts:
        for p, st in o.state.items():
            out.update((f"{names[id(p)]}.{k}", v.clone()) for k, v in st.items())
    return out


def _roundtrip(snap_env: Any, make: Any, inner: Any) -> None:
    """Train 3 steps, flush, train on; a fresh model + wrapper restores the flushed step
    with every inner optimizer's state (Adam's moments included) bit for bit."""
    model, opt = make()
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False, flush_on_close=False)
    _train(model, opt, range(3), snap)
    snap.wait()
    snap.flush()
    want = _state(model, inner(opt))
    assert len(want) == 4 + 4 * 3  # 4 parameters, each with exp_avg, exp_avg_sq, step
    _train(model, opt, range(3, 5), snap)
    snap.close()
    model2, opt2 = make()
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=snap_env.dir, job=snap_env.job + "b",
                                 health=False)
    assert snap2.restore_latest() == 3
    snap2.close()
    got = _state(model2, inner(opt2))
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_a_container_of_optimizers_is_snapshotted_through_its_inner_optimizers(snap_env):
    def make() -> tuple[Any, Any]:
        model = _parts()
        return model, Container([model["a"], model["b"]])

    model, opt = make()
    st = TrainingState(model, opt)
    assert list(st.optimizers) == ["optim.0", "optim.1"]
    assert st.optimizers["optim.1"] is opt.optimizers[1]
    _roundtrip(snap_env, make, lambda o: o.optimizers)


def test_accelerates_optimizer_is_unwrapped(snap_env):
    pytest.importorskip("accelerate", reason="accelerate not installed (requirements-extras)")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    acc = Accelerator(cpu=True)

    def make() -> tuple[Any, Any]:
        model = _parts()
        return model, acc.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    model, opt = make()
    assert isinstance(opt, AcceleratedOptimizer)
    st = TrainingState(model, opt)
    assert list(st.optimizers) == ["optim"] and st.optimizers["optim"] is opt.optimizer
    _roundtrip(snap_env, make, lambda o: [o.optimizer])


def test_lightnings_optimizer_wrapper_is_unwrapped():
    pytest.importorskip("lightning", reason="lightning not installed (requirements-extras)")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = _parts()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st = TrainingState(model, LightningOptimizer(inner))
    assert st.optimizers == {"optim": inner}


def test_a_wrapper_holding_no_state_after_its_step_is_refused(snap_env):
    model = _parts()
    opt = Hidden(list(model.parameters()))
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    try:
        with pytest.raises(ConfigError, match=r"optimizer 'optim' \(.*Hidden\) holds no state "
                                              r"after its step.*Pass the inner optimizers"):
            _train(model, opt, range(1), snap)
    finally:
        snap.close()


def test_stateless_optimizers_are_not_refused(snap_env):
    model = _parts()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state
    snap = cudasnap.Snapshotter(model, sgd, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    _train(model, sgd, range(2), snap)
    snap.close()
    model = _parts()
    opt = Hidden(list(model.parameters()))
    opt.cudasnap_stateless = True  # its owner says so
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job + "b",
                                health=False)
    _train(model, opt, range(2), snap)
    snap.close()


def test_a_wrapper_with_state_of_its_own_is_refused():
    model = _parts()
    opt = Container([model["a"], model["b"]])
    _train(model, opt, range(1))
    opt.state[next(model.parameters())]["slow"] = torch.zeros(1)  # e.g. Lookahead
    with pytest.raises(ConfigError, match=r"wraps 2 optimizer\(s\) and also holds state"):
        TrainingState(model, opt).live_tensors()


def test_one_optimizer_passed_twice_is_refused():
    model = _parts()
    opt = Container([model["a"], model["b"]])
    with pytest.raises(ConfigError, match="one optimizer"):
        TrainingState(model, {"c": opt, "x": opt.optimizers[0]})
