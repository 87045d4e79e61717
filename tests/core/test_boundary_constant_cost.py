"""O(1) boundary (issue 15 target 2): the tensor table is written once per slot per
layout, the layout check runs over a rotating window, and a replaced or moved
tensor is still found (at the next boundary while the state has <= WINDOW tensors,
within ceil(n / WINDOW) boundaries above that)."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import parts

from cudasnap import Snapshotter
from cudasnap.core import layout_watch
from cudasnap.errors import CorruptSnapshot


def _state(n_params: int = 3):
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8)) for _ in range(n_params)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _snap(env, model, opt, **kw):
    return Snapshotter(model, opt, directory=env.dir, health=False, flush_on_close=False, **kw)


def test_tensor_table_written_once_per_slot_and_manifest_whole(snap_env, native_C):
    model, opt = _state()
    snap = _snap(snap_env, model, opt)
    try:
        for step in range(7):
            opt.step()
            snap.boundary(step)
            snap.wait()
        arena, lay = parts.arena(snap), parts.layout(snap)
        assert [arena.meta_prefix_id(s) for s in range(arena.num_slots)] == [lay.prefix.id] * 3
        slot = arena.newest_complete()
        meta = json.loads(arena.read_meta(slot))  # CRC-checked over prefix + suffix
        assert meta["step"] == 6 and len(meta["tensors"]) == len(lay.tensors)
        assert meta["host"]["step"] == 6
    finally:
        snap.close()


def test_arena_prefix_reuse_and_damaged_prefix_detected(snap_env, native_C):
    C = native_C
    path = f"/dev/shm/cudasnap-{snap_env.job}-p.arena"
    arena = C.Arena.create(path, 2, 4096, 8192, 4096, snap_env.job, False)
    try:
        prefix = C.MetaPrefix(b'{"tensors":[1,2,3],"host":')
        for step in (1, 2, 3):
            slot = step % 2
            eng = C.CpuCopyEngine(1)
            plan = C.build_plan([], [], [], [], 4096, 0, 4096)
            eng.submit(arena, slot, plan, step, b'{"s":%d}}' % step, 0, prefix=prefix).wait(1, 30)
            eng.shutdown(10)
            assert json.loads(arena.read_meta(slot)) == {"tensors": [1, 2, 3], "host": {"s": step}}
            assert arena.meta_prefix_id(slot) == prefix.id
        # A bit flip in the (not rewritten) prefix of a committed slot: read_meta refuses it.
        with open(path, "r+b") as f:
            data = f.read()
            pos = data.index(b'"tensors":[1,2,3]', 4096) + 11
            f.seek(pos)
            f.write(b"9")
        with pytest.raises(CorruptSnapshot, match="manifest checksum"):
            arena.read_meta(0)  # the first slot in the file (step 2)
    finally:
        arena.unlink()


@pytest.mark.parametrize("how", ["data", "opt_state", "set_"])
def test_replaced_tensor_found_at_the_next_boundary(snap_env, how):
    model, opt = _state()
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(0)
        snap.wait()
        p = model[1]
        new = torch.full((8,), 7.0)
        if how == "data":
            p.data = new
        elif how == "opt_state":
            opt.state[p]["exp_avg"] = new  # outside optimizer.step(), no invalidate_layout()
        else:
            with torch.no_grad():
                p.set_(new)
        snap.boundary(1)
        snap.wait()
        target = {"data": lambda: p, "opt_state": lambda: opt.state[p]["exp_avg"],
                  "set_": lambda: p}[how]
        with torch.no_grad():
            target().zero_()
        snap.rollback()
        assert torch.equal(target(), torch.full((8,), 7.0)), how
    finally:
        snap.close()


def test_window_finds_a_replacement_within_n_over_window_boundaries(snap_env, monkeypatch):
    monkeypatch.setattr(layout_watch, "WINDOW", 2)
    model, opt = _state(n_params=4)  # 16 state tensors + 4 state dicts: 20 entries
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(0)
        snap.wait()
        rebuilds = snap.stats()["layout_rebuilds"]
        old = opt.state[model[3]]["exp_avg_sq"]
        opt.state[model[3]]["exp_avg_sq"] = torch.full((8,), 3.0)
        found = None
        for step in range(1, 12):
            snap.boundary(step)
            snap.wait()
            if snap.stats()["layout_rebuilds"] > rebuilds:
                found = step
                break
        assert found is not None and found <= 10, found  # ceil(20 / 2)
        assert old.data_ptr() != 0  # the stale plan's storage stayed alive meanwhile
    finally:
        snap.close()
