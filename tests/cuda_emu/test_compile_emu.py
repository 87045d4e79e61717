"""torch.compile with cudasnap on the CUDA path, under the emulated CUDA runtime
(issue 22 item 1, issue 21 item 11).

Kernels do not run here, so the graphs run with Dynamo's "eager" backend and the
state changes only through host-to-device ``copy_`` (tests/cuda_emu/emu_train.py).
The traced fence hooks emit ``cudasnap::fence`` (core/fences.py): on CUDA it makes
the current stream wait for the copy, so the compiled forward's buffer write and
the compiled optimizer step's writes stay behind the running snapshot copy.
"""
from __future__ import annotations

from typing import Any

import torch
from emu_train import build, diff, state_bytes
from helpers import parts
from helpers.slots import read_slot
from torch._dynamo.utils import counters

COPY_DELAY_US = 20_000


def _snap(model: Any, opt: Any, env: Any) -> Any:
    import cudasnap

    return cudasnap.Snapshotter(model, opt, directory=env.dir, job=env.job, health=False)


def _compiled(model: Any, opt: Any) -> tuple[Any, Any, list[Any]]:
    torch._dynamo.reset()
    counters.clear()
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return gm.forward

    return (torch.compile(model, backend=backend, fullgraph=True),
            torch.compile(opt.step, backend=backend), graphs)


def test_compiled_step_snapshot_bytes_equal_state_at_boundary(snap_env: Any, emu: Any) -> None:
    """fullgraph=True forward (writes the buffer) and compiled opt.step (parameters and
    moments): each boundary's slot == the state at the boundary, while the next step's
    compiled writes run right after it (the copy is delayed on the copy stream)."""
    model, opt = build()
    snap = _snap(model, opt, snap_env)
    cmodel, cstep, graphs = _compiled(model, opt)
    phases: list[int] = []
    real = parts.copier(snap).fence
    parts.copier(snap).fence = lambda phase: (phases.append(phase), real(phase))[1]
    try:
        checked = 0
        for i in range(4):
            cmodel(i)
            cstep()
            want = state_bytes(snap)
            if parts.cuda(snap) is not None:  # built by the first boundary
                parts.cuda(snap).engine.set_test_copy_delay_us(COPY_DELAY_US)
            snap.boundary(i)
            del phases[:]
            cmodel(1000 + i)  # compiled: fenced by the traced forward pre-hook
            cstep()  # compiled: fenced by the traced step pre-hook
            assert 0 in phases and 1 in phases, phases
            assert snap.wait(timeout=60), "snapshot did not complete"
            info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
            assert info["step"] == i
            if i > 0:  # the first boundary builds the engine: its copy is not delayed
                bad = diff(got, want)
                assert not bad, f"step {i}: slot differs from the state at the boundary: {bad}"
                checked += 1
        parts.cuda(snap).engine.set_test_copy_delay_us(0)
        assert checked == 3
        assert snap.stats()["backend"] == "cuda"
    finally:
        snap.close()


class Wrap(torch.nn.Module):
    """emu_train.Net as a submodule: the root owns no buffer (as a model whose BatchNorms
    are submodules)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build()[0]

    def forward(self, step: int) -> None:
        self.net(step)


def _counts(snap_env: Any, model: Any, attach: bool) -> tuple[int, int]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snap(model, opt, snap_env) if attach else None
    try:
        cmodel, _, graphs = _compiled(model, opt)
        for i in range(3):
            cmodel(i)
            if snap is not None:  # the next forward meets this copy running (delayed)
                snap.boundary(i)
                parts.cuda(snap).engine.set_test_copy_delay_us(COPY_DELAY_US)
        if snap is not None:
            assert snap.wait(timeout=60)
            parts.cuda(snap).engine.set_test_copy_delay_us(0)
            assert any("cudasnap.fence" in str(gm.code) for gm in graphs)
        return sum(counters["graph_break"].values()), len(graphs)
    finally:
        if snap is not None:
            snap.close()


def test_compiled_forward_has_no_graph_break_from_cudasnap(snap_env: Any, emu: Any) -> None:
    assert _counts(snap_env, Wrap(), True) == _counts(snap_env, Wrap(), False)
    # A root that owns buffers itself: Dynamo runs the root's hooks as a frame of their
    # own, outside the forward's graph (OptimizedModule: "invoke hooks outside of
    # dynamo"), so its fence is a one-op graph of its own before the forward's graph.
    breaks0, graphs0 = _counts(snap_env, build()[0], False)
    assert _counts(snap_env, build()[0], True) == (breaks0, graphs0 + 1)


def test_compiled_without_fences_the_slot_is_torn(snap_env: Any, emu: Any) -> None:
    """Negative control: the compiled fences' op calls ``_fence``; with it emptied, the
    compiled step's writes overtake the held copy and the slot is torn."""
    model, opt = build()
    snap = _snap(model, opt, snap_env)
    cmodel, cstep, _ = _compiled(model, opt)
    try:
        cmodel(0)
        cstep()
        snap.boundary(0)  # builds the engine
        assert snap.wait(timeout=60)
        parts.copier(snap).fence = lambda phase: None
        cmodel(1)
        cstep()
        want = state_bytes(snap)
        emu.hold(parts.cuda(snap).engine.copy_stream)
        try:
            snap.boundary(1)
            cmodel(1001)
            cstep()
        finally:
            emu.release()
        assert snap.wait(timeout=60)
        info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert info["step"] == 1
        assert sorted(diff(got, want)) == sorted(want), "every tensor was overwritten first"
    finally:
        snap.close()
