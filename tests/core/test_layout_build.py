"""The layout build (issue 26: the first boundary at 4,000 tensors): its shortcuts give the
same tensor table and copy sizes as the format's reference functions, and it holds
Python's cyclic GC off only while it runs, leaving the GC as it found it."""
from __future__ import annotations

import gc

import pytest
import torch
from helpers import parts

import cudasnap
from cudasnap.core.live_tensor import LiveTensor
from cudasnap.format.manifest import span_bytes, tensor_entry


def _odd_tensors() -> list[torch.Tensor]:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    return [
        torch.randn(16),
        torch.tensor(3.5),  # 0-dim
        torch.empty(0, 4),  # empty
        base.transpose(0, 2),  # non-contiguous
        base[1:],  # contiguous with a storage offset
        base[:, ::2],  # strided view
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.zeros(4, dtype=torch.bfloat16),
        torch.nn.Parameter(torch.randn(2, 2)),
    ]


@pytest.mark.parametrize("i", range(len(_odd_tensors())))
def test_entry_and_nbytes_match_the_reference(i: int) -> None:
    t = _odd_tensors()[i]
    lt = LiveTensor(f"model:m.t{i}", "model:m", t, 1)
    assert lt.nbytes == span_bytes(list(t.shape), list(t.stride()), t.element_size())
    ref = tensor_entry(lt.name, lt.group, t, 4096, lt.phase)
    got = tensor_entry(lt.name, lt.group, t, 4096, lt.phase, lt.nbytes)  # the layout's call
    assert got == ref
    assert list(got) == list(ref)  # key order: the prefix's JSON text


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)
        self.b.weight = torch.nn.Parameter(self.b.weight.detach().t().contiguous().t())
        self.register_buffer("count", torch.zeros(5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _snap(snap_env):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = _Model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt, cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu",
                                        health=False, flush_on_close=False)


def test_layout_table_matches_the_reference_entries(snap_env) -> None:
    _, _, snap = _snap(snap_env)
    try:
        snap.boundary(0)
        assert snap.wait(60)
        lay = parts.layout(snap)
        assert lay is not None
        from cudasnap.core.copy_plan import make_plan

        _, offsets = make_plan(lay.tensors, None, snap.chunk_bytes)
        for lt, off in zip(lay.tensors, offsets):
            assert tensor_entry(lt.name, lt.group, lt.tensor, off, lt.phase, lt.nbytes) == \
                tensor_entry(lt.name, lt.group, lt.tensor, off, lt.phase)
    finally:
        snap.close()


@pytest.mark.parametrize("enabled", [True, False])
def test_build_leaves_the_gc_as_it_found_it(snap_env, enabled: bool) -> None:
    _, _, snap = _snap(snap_env)
    seen: list[bool] = []
    real = snap.state.live_tensors

    def spy():  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return real()

    snap.state.live_tensors = spy  # type: ignore[method-assign]
    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        snap.boundary(0)
        assert gc.isenabled() is enabled
        assert seen and seen[0] is False  # held off during the build
    finally:
        if was:
            gc.enable()
        snap.close()


def test_build_that_raises_reenables_the_gc(snap_env) -> None:
    _, _, snap = _snap(snap_env)

    def boom():  # type: ignore[no-untyped-def]
        raise RuntimeError("walk failed")

    snap.state.live_tensors = boom  # type: ignore[method-assign]
    assert gc.isenabled()
    try:
        with pytest.raises(RuntimeError, match="walk failed"):
            snap.boundary(0)
        assert gc.isenabled()
    finally:
        del snap.state.live_tensors
        snap.close()


def test_snapshot_of_the_built_layout_restores_bitwise(snap_env) -> None:
    m, opt, snap = _snap(snap_env)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        snap.boundary(0)
        assert snap.wait(60)
        snap.flush()
    finally:
        snap.close()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
        m.count.add_(7)
    snap2 = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu", health=False,
                                 flush_on_close=False)
    try:
        assert snap2.restore_latest() == 1
    finally:
        snap2.close()
    assert all(torch.equal(want[k], v) for k, v in m.state_dict().items())
