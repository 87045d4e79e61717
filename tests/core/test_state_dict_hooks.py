"""A snapshot holds the tensors training writes (parameters, persistent buffers), never
what a ``state_dict`` hook returns (issue 32): torchtitan's llama3 splits its fused q/k/v
parameter into fresh copies in a hook, and a snapshot of those copies restored into
nothing. Modules whose state lives outside their parameters and buffers are refused,
naming the module. FSDP2 with the same hook: tests/distributed/test_sharded.py (fused)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import cudasnap
from cudasnap.core.state import TrainingState
from cudasnap.errors import ConfigError
from tools.dist.fused import FusedQKV as Fused


def _build(copy: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Fused(8, 4, copy), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
           snap: Any = None) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        model(torch.randn(5, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if snap is not None:
            snap.boundary(step)


def _params(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    out.update((f"{names[id(p)]}.{k}", v.clone()) for p, st in opt.state.items()
               for k, v in st.items() if isinstance(v, torch.Tensor))
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("copy", [True, False], ids=["hook-copies", "hook-views"])
def test_fused_parameter_split_by_a_hook_resumes_bitwise(snap_env, copy: bool) -> None:
    model, opt = _build(copy)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False, flush_on_close=False)
    _train(model, opt, range(3), snap)
    snap.wait()
    snap.flush()  # step 2
    at_flush = _params(model, opt)
    _train(model, opt, range(3, 6), snap)
    snap.close()
    assert _same(at_flush, _params(model, opt))  # training moved the state on

    model2, opt2 = _build(copy)
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=snap_env.dir, job=snap_env.job + "b",
                                 health=False)
    assert snap2.restore_latest() == 3
    snap2.close()
    assert _same(at_flush, _params(model2, opt2)) == []  # the parameter, not a copy of it


def test_the_parameter_is_named_by_its_path_and_views_or_copies_are_not_snapshotted():
    model, opt = _build(copy=True)
    _train(model, opt, range(1))
    names = [lt.name for lt in TrainingState(model, opt).live_tensors()]
    assert "model.0.wqkv" in names
    assert not any(n.endswith((".wq", ".wk", ".wv")) for n in names), names
    plain = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    want = [f"model.{k}" for k in plain.state_dict()]  # default names unchanged
    assert [lt.name for lt in TrainingState(plain, None).live_tensors()] == want


def test_a_hook_that_only_renames_keeps_get_state_dict_names():
    """Activation checkpointing's hook drops ``_checkpoint_wrapped_module.`` from the keys:
    its values are the parameters, so the snapshot keeps state_dict's names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)), torch.nn.Linear(4, 1))
    names = [lt.name for lt in TrainingState(model, None).live_tensors()]
    assert names == [f"model.{k}" for k in model.state_dict()], names
    assert "model.0.weight" in names


class ExtraState(torch.nn.Linear):
    def get_extra_state(self) -> Any:
        return {"scale": 2.0}

    def set_extra_state(self, state: Any) -> None:
        pass


class Packed(torch.nn.Module):
    """Weights in a plain attribute, emitted by a ``_save_to_state_dict`` override (as
    packed/quantized modules do): not a parameter or buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.packed = torch.zeros(4)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "packed"] = self.packed


def test_state_outside_parameters_and_buffers_is_refused_naming_the_module():
    with pytest.raises(ConfigError, match=r"module 'model\.1' \(ExtraState\).*get_extra_state"):
        TrainingState(torch.nn.Sequential(torch.nn.Linear(2, 2), ExtraState(2, 2)), None)
    with pytest.raises(ConfigError, match=r"model\.1\.packed .* neither a parameter nor a buffer"):
        TrainingState(torch.nn.Sequential(torch.nn.Linear(2, 2), Packed()), None)


def test_compiled_and_checkpoint_wrapped_fused_model_resumes_bitwise(snap_env) -> None:
    """torch.compile over an activation-checkpoint-wrapped fused module (torchtitan's
    stack): names through both wrappers, the parameter restored."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build() -> tuple[Any, Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        inner = torch.nn.Sequential(checkpoint_wrapper(Fused(8, 4)), torch.nn.Linear(4, 2))
        return inner, torch.compile(inner, backend="eager"), torch.optim.AdamW(
            inner.parameters(), lr=1e-2)

    inner, compiled, opt = build()
    snap = cudasnap.Snapshotter(compiled, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False, flush_on_close=False)
    _train(compiled, opt, range(2), snap)
    snap.wait()
    snap.flush()
    want = _params(inner, opt)
    _train(compiled, opt, range(2, 4), snap)
    snap.close()
    inner2, compiled2, opt2 = build()
    snap2 = cudasnap.Snapshotter(compiled2, opt2, directory=snap_env.dir,
                                 job=snap_env.job + "b", health=False)
    assert snap2.restore_latest() == 2
    snap2.close()  # (step 1 flushed: resume at 2)
    assert _same(want, _params(inner2, opt2)) == []


def test_cudasnap_never_calls_the_models_state_dict(snap_env) -> None:
    """torchtitan's fused q/k/v hook all-gathers the sharded parameter: its state_dict() is a
    collective, which one rank alone (a flush, a background layout build) would hang in.
    Construction, boundaries, flush, restore and the layout never call it."""
    class Collective(Fused):
        @staticmethod
        def _split(mod: Any, sd: dict[str, Any], prefix: str, _: Any) -> None:
            raise AssertionError("state_dict() called: a collective on one rank")

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(Collective(8, 4), torch.nn.Linear(4, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    _train(model, opt, range(3), snap)
    snap.wait()
    snap.flush()
    want = _params(model, opt)
    snap.close()
    model2, opt2 = build()
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=snap_env.dir, job=snap_env.job + "b",
                                 health=False)
    assert snap2.restore_latest() == 3
    snap2.close()
    assert _same(want, _params(model2, opt2)) == []


def test_export_dcp_of_a_hooked_model_says_what_a_loader_will_miss(snap_env, tmp_path,
                                                                  caplog) -> None:
    """The export holds the parameter (wqkv) under its own name; a loader asking for the
    hook's keys (wq/wk/wv) would miss them: said at export, naming the module."""
    import logging

    from cudasnap.tools.export import export_dcp

    model, opt = _build(True)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    _train(model, opt, range(2), snap)
    snap.close()  # flushes step 1
    with caplog.at_level(logging.WARNING, logger="cudasnap.export"):
        export_dcp(snap_env.dir, tmp_path / "dcp")
    assert "state_dict of model.0 is built by hooks" in caplog.text, caplog.text
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert "hooked" not in TrainingState(plain, None).dcp_names()
