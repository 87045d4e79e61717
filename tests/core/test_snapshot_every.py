"""The paper's zero-overhead mode (issue 15 target 5): ``snapshot_every=k`` copies every
k-th boundary; a flush with no optimizer step since the last boundary copies the live
state of that step (replay <= 1 step), otherwise it writes the newest COMPLETE slot
(replay <= k steps). Restore gives bitwise the state of the flushed step."""
from __future__ import annotations

import pytest
import torch

from cudasnap import Snapshotter
from cudasnap.errors import ConfigError


def _train(n: int = 3):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def _one_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 6, generator=g)
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _flat(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, (p, st) in enumerate(opt.state.items()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"o.{i}.{k}"] = v.detach().clone()
    return out


def _snap(env, model, opt, **kw):
    return Snapshotter(model, opt, directory=env.dir, health=False, flush_on_close=False,
                       snapshot_every=4, **kw)


def _restored(env, expect_step: int) -> dict[str, torch.Tensor]:
    model, opt = _train()
    _one_step(model, opt, 999)  # different live values, optimizer state present
    snap = Snapshotter(model, opt, directory=env.dir, health=False, flush_on_close=False)
    try:
        assert snap.restore_latest() == expect_step + 1
        assert snap.stats()["restore"]["source"] == "disk"
        return _flat(model, opt)
    finally:
        snap.close()


def _run_to_6(env):
    model, opt = _train()
    snap = _snap(env, model, opt)
    ref = {}
    for step in range(7):
        _one_step(model, opt, step)
        snap.boundary(step)
        ref[step] = _flat(model, opt)
    return model, opt, snap, ref


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_flush_with_no_step_since_saves_the_live_step(snap_env):
    model, opt, snap, ref = _run_to_6(snap_env)
    try:
        st = snap.stats()
        assert st["snapshots"] == 2 and st["skipped_every"] == 5  # steps 0 and 4 copied
        path = snap.flush()
        assert path is not None and path.name.endswith("6"), path
        assert snap.stats()["live_saves"] == 1
    finally:
        snap.close(keep_arena=False)
    _assert_bitwise(_restored(snap_env, 6), ref[6])


def test_flush_after_an_optimizer_step_saves_the_newest_complete_slot(snap_env):
    model, opt, snap, ref = _run_to_6(snap_env)
    try:
        _one_step(model, opt, 7)  # the state moved past step 6; no boundary
        path = snap.flush()
        assert path is not None and path.name.endswith("4"), path
        assert snap.stats()["live_saves"] == 0
    finally:
        snap.close()
    _assert_bitwise(_restored(snap_env, 4), ref[4])


def test_buffer_forward_since_the_boundary_also_counts_as_moved(snap_env):
    """BatchNorm running stats change in a forward (no optimizer step): not step 6 any more."""
    model, opt, snap, ref = _run_to_6(snap_env)
    try:
        model(torch.randn(4, 6))
        path = snap.flush()
        assert path is not None and path.name.endswith("4"), path
    finally:
        snap.close()
    _assert_bitwise(_restored(snap_env, 4), ref[4])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_snapshot_every_must_be_a_positive_int(snap_env, bad):
    model, opt = _train()
    with pytest.raises(ConfigError, match="snapshot_every"):
        Snapshotter(model, opt, directory=snap_env.dir, health=False, snapshot_every=bad)
