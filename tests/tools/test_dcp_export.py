"""`cudasnap export --to dcp` read the way torch.distributed.checkpoint users read it:
``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict`` (nested and flattened optimizer
forms), torchtitan's CheckpointManager layout, and ``load_resharded`` on old and new exports.
(The FSDP2 form on another world size: tests/distributed/test_sharded_dist.py.)"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import cudasnap
from cudasnap.errors import ConfigError
from cudasnap.tools.cli import main
from cudasnap.tools.export import export_dcp, load_tensors

DATA = Path(__file__).resolve().parents[1] / "data" / "dcp_v1"  # made by its make.py with the first export


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(6, 5)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return torch.tanh(self.inner(x))


def _build(seed: int, wrap: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Block(), torch.nn.Linear(5, 3))
    if wrap:  # activation checkpointing: state_dict keys gain "_checkpoint_wrapped_module."
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model[0] = checkpoint_wrapper(model[0])
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                             {"params": model[1].parameters(), "lr": 3e-3}])
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    return model, opt, sched


def _train(tmp: Path, wrap: bool = False, steps: int = 4) -> tuple[Path, dict[str, Any]]:
    """A snapshotted run; returns (its directory, the live state after its last step)."""
    model, opt, sched = _build(0, wrap)
    snap = cudasnap.Snapshotter(model, opt, directory=tmp / "ckpt", backend="cpu",
                                extra={"sched": sched})
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        snap.boundary(step)
    snap.close()
    msd, osd = get_state_dict(model, opt)
    return tmp / "ckpt", {"model": _clone(msd), "optim": _clone(osd),
                          "sched": sched.state_dict()}


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def _same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested state (tensors by bytes, everything else by ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                           if b.dim() else b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _load(sd: dict[str, Any], ckpt: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*load_state_dict.*process group.*")
        dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_get_state_dict_dcp_load_set_state_dict_is_bitwise(tmp_path: Path, flatten: bool) -> None:
    """The DCP keys of torch.distributed.checkpoint.state_dict: model.<fqn>,
    optim.state.<fqn>.<key>, optim.param_groups.<i | fqn>.<key> (the import used to raise
    "Missing key in checkpoint state_dict: optim.state.<fqn>.step")."""
    ckpt, want = _train(tmp_path)
    out = export_dcp(ckpt, tmp_path / "dcp")
    model, opt, _ = _build(7)  # other weights, empty optimizer
    opts = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=opts)
    sd = {"model": msd, "optim": osd}
    _load(sd, out)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=opts)
    msd, osd = get_state_dict(model, opt)
    _same(want["model"], msd, "model")
    _same(want["optim"], osd, "optim")  # state by FQN and every param-group value (lr too)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in want["optim"]["param_groups"]]


def test_wrapped_module_names_are_the_fqns_get_state_dict_uses(tmp_path: Path) -> None:
    """A snapshot of a module under activation checkpointing (state_dict keys with
    ``_checkpoint_wrapped_module.``) loads into the plain module by get_state_dict's FQNs."""
    ckpt, want = _train(tmp_path, wrap=True)
    out = export_dcp(ckpt, tmp_path / "dcp")
    model, opt, _ = _build(7)
    msd, osd = get_state_dict(model, opt)
    assert "0.inner.weight" in msd
    sd = {"model": msd, "optim": osd}
    _load(sd, out)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got_m, got_o = get_state_dict(model, opt)
    _same(want["model"], got_m, "model")  # get_state_dict of the wrapped one: the same FQNs
    _same(want["optim"], got_o, "optim")


def test_torchtitan_checkpoint_layout(tmp_path: Path) -> None:
    """torchtitan's CheckpointManager: model FQNs at the top level, the flattened optimizer
    under "optimizer", "lr_scheduler" and "train_state.step"."""
    ckpt, want = _train(tmp_path, steps=5)
    out = export_dcp(ckpt, tmp_path / "dcp")
    model, opt, sched = _build(7)
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    sd: dict[str, Any] = {**msd, "optimizer": osd, "lr_scheduler": sched.state_dict(),
                          "train_state": {"step": torch.tensor(0, dtype=torch.int32)}}
    _load(sd, out)
    set_state_dict(model, opt, model_state_dict={k: sd[k] for k in msd},
                   optim_state_dict=sd["optimizer"], options=opts)
    sched.load_state_dict(sd["lr_scheduler"])
    assert int(sd["train_state"]["step"]) == 4  # the step the snapshot was taken after
    got_m, got_o = get_state_dict(model, opt)
    _same(want["model"], got_m, "model")
    _same(want["optim"], got_o, "optim")
    _same(want["sched"], sched.state_dict(), "sched")


def test_each_tensor_is_stored_once(tmp_path: Path) -> None:
    """Every name of a tensor points at the same stored bytes (no copy per key form)."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt, _ = _train(tmp_path)
    out = export_dcp(ckpt, tmp_path / "dcp")
    md = FileSystemReader(str(out)).read_metadata()
    loc = {(i.fqn, tuple(i.offset or ())): (s.relative_path, s.offset)
           for i, s in md.storage_data.items()}
    a = loc[("optim.state.0.inner.weight.exp_avg", (0, 0))]
    assert a == loc[("optimizer.state.0.inner.weight.exp_avg", (0, 0))] == \
        loc[("optim.state.0.exp_avg", (0, 0))]
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, _ = load_tensors(ckpt)
    tensor_keys = [k for k, v in md.state_dict_metadata.items()
                   if isinstance(v, TensorStorageMetadata)]
    assert len(tensor_keys) > 2 * len(tensors)  # several names per tensor...
    stored = {loc[(i.fqn, tuple(i.offset or ()))] for i in md.storage_data
              if i.fqn in tensor_keys}
    assert len(stored) == len(tensors) + 1  # ...one stored copy each (+ train_state.step)


def test_load_resharded_reads_old_and_new_exports(tmp_path: Path) -> None:
    """An export written before the FQN keys (tests/data/dcp_v1/export) and a new export of
    the same snapshot both load through load_resharded, bitwise as the snapshot holds it."""
    shutil.copytree(DATA / "ckpt", tmp_path / "ckpt")
    tensors, m = load_tensors(tmp_path / "ckpt")
    new = export_dcp(tmp_path / "ckpt", tmp_path / "new")
    for out in (DATA / "export", new):
        torch.manual_seed(9)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1.0},
                                 {"params": model[2].parameters(), "lr": 1.0}])
        assert cudasnap.load_resharded(out, model, opt) == m["step"] + 1
        for k, v in model.state_dict().items():
            assert torch.equal(v, tensors[f"model.{k}"]), (out, k)
        for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
            for k, v in opt.state[p].items():
                assert torch.equal(v, tensors[f"optim.state.{i}.{k}"]), (out, i, k)
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]


def test_export_dcp_target_checks_and_no_partial_output(tmp_path: Path) -> None:
    ckpt, _ = _train(tmp_path, steps=2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_dcp(ckpt, tmp_path / "full")
    with pytest.raises(ConfigError, match="inside the snapshot directory"):
        export_dcp(ckpt, ckpt / "dcp")
    with pytest.raises(ConfigError, match="does not exist"):
        export_dcp(ckpt, tmp_path / "no" / "such" / "dcp")
    assert main(["export", str(ckpt), "--to", "dcp", str(tmp_path / "cli")]) == 0
    files = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert ".metadata" in files and "cudasnap_host.json" in files
    assert all(((tmp_path / "cli" / f).stat().st_mode & 0o777) == 0o600 for f in files)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # nothing left beside it


def test_readme_dcp_snippet_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """README's DCP snippet (after the quick start's ckpt and `cudasnap export ckpt --to dcp
    ckpt-dcp`) loads the snapshot's bytes."""
    import re
    import textwrap

    text = (Path(__file__).parents[2] / "README.md").read_text()
    code = re.search(r"<!-- dcp-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert code, "README lost its dcp-snippet block"
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    snap = cudasnap.Snapshotter(model, opt, directory="ckpt", backend="cpu")
    for step in range(2):
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snap.boundary(step)
    snap.close()
    assert main(["export", "ckpt", "--to", "dcp", "ckpt-dcp"]) == 0
    ns: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(textwrap.dedent(code.group(1)), "README.md", "exec"), ns)
    _same({k: v for k, v in model.state_dict().items()}, ns["model"].state_dict(), "model")
    _same(get_state_dict(model, opt)[1], get_state_dict(ns["model"], ns["opt"])[1], "optim")
