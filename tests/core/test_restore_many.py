"""Restore with many tensors (issue 15 target 6a): the per-tensor work is native or done once.

* ``copy_back.copy_into`` plans its byte copies natively (``_C.copy_pairs``); the Python
  planner ``plan_reference`` keeps the rules, and both must agree pair by pair;
* ``manifest.validate_tensors`` takes a fast path that accepts exactly what the
  entry-by-entry check accepts, which still names the first problem;
* a restore walks the live state once and builds no view for a plain contiguous tensor.
"""
from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from helpers import parts
from torch import nn

import cudasnap
from cudasnap.core import copy_back
from cudasnap.core import state as state_mod
from cudasnap.errors import CorruptSnapshot
from cudasnap.format import manifest as M


def _entry(shape: list[int], stride: list[int], dtype: str, offset: int) -> dict:
    item = parts.itemsize(dtype)
    return {"name": f"t{offset}", "group": "model:model", "dtype": dtype, "shape": shape,
            "stride": stride, "storage_offset": 0, "offset": offset,
            "nbytes": M.span_bytes(shape, stride, item), "phase": 1}


class Sub(torch.Tensor):
    pass


def _pairs(data: torch.Tensor, seed: int) -> list[tuple[torch.Tensor, object]]:
    """Every kind of (destination, snapshot value) pair copy_into meets, shuffled."""
    rnd = random.Random(seed)
    n = data.numel()
    out: list[tuple[torch.Tensor, object]] = []
    off = 0

    def take(nbytes: int) -> int:
        nonlocal off
        o = off
        off += (nbytes + 63) // 64 * 64
        assert off <= n
        return o

    for _ in range(12):  # plain: entries of contiguous views, Parameters too
        shape = [rnd.randint(1, 9) for _ in range(rnd.randint(0, 3))]
        dst = torch.zeros(shape)
        e = _entry(shape, list(dst.stride()), "float32", take(dst.nbytes))
        out.append((nn.Parameter(dst) if rnd.random() < 0.3 else dst, e))
    t = torch.zeros(3, 1, 4)  # a size-1 dimension with another stride: still contiguous
    out.append((t, _entry([3, 1, 4], [4, 99, 1], "float32", take(t.nbytes))))
    t = torch.zeros(5, 6)  # the entry is a transposed view: torch copies it
    out.append((t, _entry([5, 6], [1, 5], "float32", take(t.nbytes))))
    out.append((torch.zeros(4, 6).t(), _entry([6, 4], [4, 1], "float32", take(96))))
    out.append((torch.zeros(8, dtype=torch.float64), _entry([8], [1], "float32", take(32))))
    out.append((torch.zeros(2, 8), _entry([8], [1], "float32", take(32))))  # broadcast
    out.append((torch.zeros(0, 3), _entry([0, 3], [3, 1], "float32", take(0))))
    out.append((torch.zeros(6).as_subclass(Sub), _entry([6], [1], "float32", take(24))))
    base = torch.zeros(40)  # overlapping destinations: sequential torch copies
    out.append((base[:24], _entry([24], [1], "float32", take(96))))
    out.append((base[16:], _entry([24], [1], "float32", take(96))))
    src_in = data[take(64):][:64].view(torch.float32)  # a tensor value inside the buffer
    out.append((torch.zeros(16), src_in[:16]))
    out.append((torch.zeros(16), torch.arange(16, dtype=torch.float32)))  # outside it
    out.append((torch.zeros(2, 2, dtype=torch.complex64),
                _entry([2, 2], [2, 1], "complex64", take(32))))
    out.append((torch.zeros(2, 2, dtype=torch.complex64).conj(),
                _entry([2, 2], [2, 1], "complex64", take(32))))
    out.append((torch.zeros(3, dtype=torch.int64), _entry([3], [1], "int64", take(24))))
    rnd.shuffle(out)
    return out


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach()
    t = t.resolve_conj() if t.is_conj() else t
    return bytes(t.contiguous().view(-1).view(torch.uint8).tolist()) if t.numel() else b""


@pytest.mark.parametrize("seed", range(6))
def test_native_plan_matches_the_python_reference(native_C, seed):
    data = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8)
    data.view(torch.float32)[:] = torch.randn(data.numel() // 4)  # no NaN: compare values too
    got, want = _pairs(data, seed), _pairs(data, seed)
    want_data = data.clone()
    spans, fast, slow = copy_back.plan_reference(want, data)
    assert native_C.plan_pairs(  # lo 0: no byte copies, everything to torch
        [d for d, _ in got], [s for _, s in got], *parts.copy_back_kinds(),
        torch.Tensor, 0, 0).slow == list(range(len(got)))
    versions = [d._version for d, _ in got]
    moved_ref = copy_back.copy_into(want, data, threads=2, reference=True)
    moved = copy_back.copy_into(got, data, threads=2)
    assert moved == moved_ref == sum(n for _, _, n in spans) > 0
    assert len(fast) >= 12 and len(slow) >= 8  # both kinds are exercised
    for (g, _), (w, _) in zip(got, want):
        assert _bits(g) == _bits(w)
    assert torch.equal(data, want_data)  # the source is never written
    for (d, _), v in zip(got, versions):
        assert d._version > v  # byte copy or copy_: autograd sees the change


def test_native_plan_fast_set_is_the_reference_fast_set(native_C, monkeypatch):
    """Pair by pair: what the native planner copies itself is what plan_reference copies."""
    data = torch.zeros(1 << 14, dtype=torch.uint8)
    pairs = _pairs(data, 11)
    _, fast, slow = copy_back.plan_reference(pairs, data)
    plan = native_C.plan_pairs(
        [d for d, _ in pairs], [s for _, s in pairs], *parts.copy_back_kinds(),
        torch.Tensor, data.data_ptr(), data.numel())
    slow_native = plan.slow
    assert plan.count == len(fast)
    assert slow_native == slow


def test_an_unusable_entry_raises_before_a_byte_is_written(native_C):
    data = torch.zeros(256, dtype=torch.uint8)
    a, b = torch.ones(8), torch.ones(8)
    e = _entry([8], [1], "float32", 0)
    bad = dict(e, offset=10**6)  # validation refuses it; here its view cannot be made
    with pytest.raises(RuntimeError, match="out of bounds"):
        copy_back.copy_into([(a, e), (b, bad)], data)
    assert a.eq(1).all() and b.eq(1).all()  # the good pair's byte copy did not run either
    assert copy_back.copy_into([(a, e)], data) == 32 and not a.any()


def _table(n: int) -> tuple[list[dict], int]:
    out, off = [], 0
    for i in range(n):
        e = _entry([i % 7 + 1, 3], [3, 1], ["float32", "bfloat16", "int64"][i % 3], off)
        e["name"] = f"model.layer{i}.w"
        out.append(e)
        off += (e["nbytes"] + 15) // 16 * 16
    return out, off


MUTATIONS = [
    ("name", ""), ("name", 5), ("name", "a\x00"), ("name", "model.layer0.w"), ("dtype", "obj"),
    ("dtype", None), ("shape", [1, 2, 3]), ("shape", "x"), ("shape", [True, 3]),
    ("stride", [3.0, 1]), ("stride", [2**48, 1]), ("offset", -16), ("offset", 2), ("offset", 1.0),
    ("offset", True), ("offset", 10**30), ("nbytes", 4), ("nbytes", None), ("phase", 2),
    ("phase", True), ("phase", 0), ("group", None), ("group", 3), ("shard", 1),
    ("shard", {"global_shape": [9, 3], "mesh_shape": [2], "offset": [0, 0],
               "placements": ["Shard(0)"], "mesh_dims": ["dp"], "coord": [0]}),
]


@pytest.mark.parametrize("key, value", MUTATIONS)
def test_fast_table_check_accepts_exactly_what_the_full_check_accepts(key, value):
    """Each single mutation, at a random entry of 3,000: the fast path's verdict is the
    full check's, and a refusal names the same entry with the same words."""
    rnd = random.Random(hash((key, str(value))) & 0xFFFF)
    base, size = _table(3000)
    for at in (0, rnd.randrange(3000), 2999):
        t = copy.deepcopy(base)
        t[at][key] = value
        try:
            parts.check_tensors(t, size, "W")
            full = None
        except CorruptSnapshot as e:
            full = str(e)
        assert parts.tensors_sound(t, size) is (full is None)
        if full is None:
            M.validate_tensors(t, size, "W")
        else:
            with pytest.raises(CorruptSnapshot) as ei:
                M.validate_tensors(t, size, "W")
            assert str(ei.value) == full


def test_fast_table_check_on_the_data_size_edge():
    t, size = _table(10)
    last = t[-1]
    end = last["offset"] + last["nbytes"]
    assert parts.tensors_sound(t, end) and not parts.tensors_sound(t, end - 1)
    with pytest.raises(CorruptSnapshot, match="outside the data"):
        M.validate_tensors(t, end - 1, "W")


def test_empty_like_entry_is_empty_like_of_the_view():
    data = torch.zeros(4096, dtype=torch.uint8)
    for e in [_entry([5, 3], [3, 1], "float32", 0), _entry([3, 5], [1, 3], "float32", 64),
              _entry([2, 1, 4], [4, 7, 1], "bfloat16", 128), _entry([], [], "int64", 256),
              _entry([0, 4], [4, 1], "float16", 0)]:
        got = copy_back.empty_like_entry(data, e)
        want = torch.empty_like(copy_back.entry_view(data, e))
        assert (got.shape, got.stride(), got.dtype, got.device) == (
            want.shape, want.stride(), want.dtype, want.device)


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(3 + i % 5)) for i in range(n)])
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def _trained(n: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = Many(n)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return m, opt


def _state(m: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in m.state_dict().values()] + [
        v.clone() for s in opt.state_dict()["state"].values() for v in s.values()]


@pytest.mark.parametrize("fresh", [False, True], ids=["rollback", "new-process"])
def test_many_tensor_restore_walks_the_state_once_and_builds_no_views(snap_env, monkeypatch,
                                                                      fresh):
    m, opt = _trained(500)  # 2,001 snapshot tensors
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir)
    try:
        snap.arena_ready()  # the background set-up skips boundaries until then
        snap.boundary(0)
        snap.wait()
        want = _state(m, opt)
        walks: list[int] = []
        views: list[int] = []
        real_walk, real_view = state_mod.TrainingState.live_tensors, copy_back.entry_view
        me = threading.get_ident()  # not the background arena set-up's walks
        monkeypatch.setattr(state_mod.TrainingState, "live_tensors", lambda self: (
            walks.append(1) if threading.get_ident() == me else None) or real_walk(self))
        monkeypatch.setattr(copy_back, "entry_view",
                            lambda *a: views.append(1) or real_view(*a))
        if fresh:  # a new process: new objects, optimizer without state
            torch.manual_seed(1)
            m2 = Many(500)
            opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
            snap.close(keep_arena=True)
            snap = cudasnap.Snapshotter(m2, opt2, directory=snap_env.dir)
            walks.clear()
            assert snap.restore_latest() == 1
            got = _state(m2, opt2)
        else:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)
            assert snap.rollback() == 1
            got = _state(m, opt)
    finally:
        snap.close()
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert walks == [1]  # live_tensors once per restore (it was twice)
    assert views == []  # every tensor was a byte copy planned from its entry


@pytest.mark.parametrize("incompatible", [False, True])
def test_a_damaged_slot_is_reported_as_such_and_copies_nothing(snap_env, incompatible):
    """The CRC32C check runs beside the state checks: a flipped data byte is still what
    restore_slot reports (also when the live model does not fit the snapshot either),
    and not one byte reaches the live tensors."""
    from cudasnap.errors import IncompatibleSnapshot
    from tools.faults import layout as L

    m, opt = _trained(50)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir)
    try:
        snap.arena_ready()
        snap.boundary(0)
        snap.wait()
        arena = parts.arena(snap)
        slot = arena.newest_complete()
        where = f"{arena.path} slot {slot}"
        if incompatible:  # a live tensor of another shape: the state check fails too
            m.ps[3] = nn.Parameter(torch.zeros(2))
            with pytest.raises(IncompatibleSnapshot):
                snap.restore_slot(arena, slot, where)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(7.0)
        geo = (arena.data_capacity, arena.meta_capacity, arena.chunk_bytes)
        n = arena.slot_info(slot)["data_bytes"]
        L.flip_byte(arena.path, L.data_offset(slot, *geo) + n - 1, 0x40)
        with pytest.raises(CorruptSnapshot, match="fails its CRC32C"):
            snap.restore_slot(arena, slot, where)
    finally:
        snap.close()
    assert all(bool(p.eq(7.0).all()) for p in m.parameters())
    assert parts.partly_applied(snap) is None
