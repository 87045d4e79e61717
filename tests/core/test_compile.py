"""torch.compile with cudasnap attached (issue 22 item 1, issue 21 item 11).

Under Dynamo the fence hooks emit the custom op ``cudasnap::fence`` (core/fences.py,
docs/design.md §3.2.1) instead of calling into Python/pybind: no graph break, the
same graphs as without cudasnap, ``fullgraph=True`` works, and the fence still runs
(every step) before the compiled code writes the state. CPU backend: the fence is a
host wait; a copy is stalled with ``set_test_chunk_delay_us`` (as in
test_snapshot_safety), so a write that overtook the copy would be seen in the
snapshot, and a forward or step that returned without waiting fails the asserts.
"""
from __future__ import annotations

import threading

import pytest
import torch
from helpers import parts
from torch import nn
from torch._dynamo.utils import counters

import cudasnap

CHUNK = 4 << 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)))


def _snap(env, model, opt):
    return cudasnap.Snapshotter(model, opt, directory=env.dir, copy_threads=1,
                                chunk_bytes=CHUNK)


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state_dict()["state"].values()):
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def _compile_counts(env, attach: bool, what: str) -> tuple[int, int, list[int]]:
    """(graph breaks, graphs, fences run) of 3 steps of a compiled model (``what`` =
    "model") or a compiled ``opt.step`` ("step"), with a boundary after each step when
    ``attach``."""
    torch._dynamo.reset()
    counters.clear()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snap = _snap(env, model, opt) if attach else None
    fences: list[int] = []
    if snap is not None:
        real = parts.copier(snap).fence
        parts.copier(snap).fence = lambda phase: (fences.append(phase), real(phase))[1]
    cmodel = torch.compile(model, backend=backend) if what == "model" else model
    cstep = torch.compile(opt.step, backend=backend) if what == "step" else opt.step
    try:
        for step in range(3):
            cmodel(torch.randn(8, 16)).sum().backward()
            cstep()
            opt.zero_grad(set_to_none=True)
            if snap is not None:
                # The next forward and step meet this copy running (slowed): the hooks
                # take their waiting path (traced eagerly, it was Dynamo-unsupported).
                snap.boundary(step)
                parts.engine(snap).set_test_chunk_delay_us(20_000)
    finally:
        if snap is not None:
            snap.close()
    breaks = sum(counters["graph_break"].values())
    return breaks, len(graphs), fences


@pytest.mark.slow
def test_compiled_model_has_the_graph_breaks_and_graphs_it_has_without_cudasnap(snap_env):
    breaks0, graphs0, _ = _compile_counts(snap_env, attach=False, what="model")
    breaks1, graphs1, fences = _compile_counts(snap_env, attach=True, what="model")
    # Before the custom op: 2 breaks and one graph more.
    assert (breaks1, graphs1) == (breaks0, graphs0), ((breaks0, graphs0), (breaks1, graphs1))
    # The compiled forward fenced at every step (compiled once, run 3 times): one
    # fence per module owning buffers (2 BatchNorms) per forward.
    assert fences.count(0) == 6, fences


@pytest.mark.slow
def test_compiled_optimizer_step_fences_with_no_new_graph_break(snap_env):
    breaks0, graphs0, _ = _compile_counts(snap_env, attach=False, what="step")
    breaks1, graphs1, fences = _compile_counts(snap_env, attach=True, what="step")
    assert breaks1 == breaks0, (breaks0, breaks1)
    # torch.optim's step wrapper has a graph break of its own between the step
    # pre-hooks and the step: the fence is a graph of its own before it.
    assert graphs1 == graphs0 + 1, (graphs0, graphs1)
    assert fences.count(1) == 3, fences


def test_fullgraph_model_compile_does_not_raise_with_the_eager_backend(snap_env):
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = _snap(snap_env, model, opt)
    try:
        cmodel = torch.compile(model, backend="aot_eager", fullgraph=True)
        for step in range(2):
            cmodel(torch.randn(8, 16)).sum().backward()
            opt.step()
            snap.boundary(step)
        assert snap.wait(30)
    finally:
        snap.close()


@pytest.mark.slow
def test_fullgraph_inductor_fences_a_stalled_copy_every_step(snap_env):
    """``torch.compile(model, fullgraph=True)`` and ``torch.compile(opt.step)`` (Inductor,
    the default backend): at every boundary the copy is stalled, the compiled forward
    must wait for the buffers (phase 0) and the compiled step for the rest (phase 1);
    the last snapshot holds the state at its boundary, bitwise."""
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cmodel = torch.compile(model, fullgraph=True)
    cstep = torch.compile(opt.step)
    snap = _snap(snap_env, model, opt)
    phases: list[int] = []
    real = parts.copier(snap).fence
    parts.copier(snap).fence = lambda phase: (phases.append(phase), real(phase))[1]

    def train() -> None:
        cmodel(torch.randn(8, 16)).sum().backward()
        cstep()
        opt.zero_grad(set_to_none=True)

    try:
        train()  # compiles (the fences are no-ops: no copy yet)
        snap.boundary(0)
        assert snap.wait(60)
        eng = parts.engine(snap)
        want: dict[str, torch.Tensor] = {}
        for step in range(1, 4):
            train()
            want = _state(model, opt)
            eng.set_test_chunk_delay_us(30_000_000)  # stalled until the timer below
            snap.boundary(step)
            job = parts.job(snap)
            assert job is not None and not job.done(0)
            threading.Timer(0.3, eng.set_test_chunk_delay_us, (0,)).start()
            del phases[:]
            x = torch.randn(8, 16)
            out = cmodel(x)  # writes the BatchNorm buffers: only after phase 0
            assert job.done(0), f"step {step}: the compiled forward did not wait"
            assert 0 in phases
            out.sum().backward()
            cstep()  # writes parameters and Adam state: only after the copy
            assert job.done(1), f"step {step}: the compiled optimizer step did not wait"
            assert 1 in phases
            opt.zero_grad(set_to_none=True)
            assert snap.wait(60)
        m2 = _model()
        o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
        snap.close(keep_arena=True)
        snap = _snap(snap_env, m2, o2)
        assert snap.restore_latest() == 4
        got = _state(m2, o2)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    finally:
        snap.close()
