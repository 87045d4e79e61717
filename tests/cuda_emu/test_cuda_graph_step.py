"""A training step captured with torch.cuda.graph and replayed, with cudasnap attached
(issue 22 item 2, emulated lane): captured while a snapshot copy is in flight, the capture
is not invalidated; with ``snap.fence()`` before each replay (README: "a CUDA-graph replay
of the step") every snapshot holds the state at its boundary, bit for bit; without the
fence the replay overtakes the copy (negative control).

The captured "step" writes every state tensor with device-to-device copies from a device
source that each iteration refills (kernels do not run under the emulator).
"""
from __future__ import annotations

from typing import Any

import torch
from emu_train import build, diff, pattern, state_bytes
from helpers import parts
from helpers.slots import read_slot


class GraphStep:
    """Captures `state[k].copy_(src[k])` for every state tensor; replay() runs them."""

    def __init__(self, snap: Any) -> None:
        self.state = [lt.tensor for lt in snap.state.live_tensors()]
        self.src = [torch.empty_like(t) for t in self.state]
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch advises
            self.copy()
            # capture_begin/end: torch.cuda.graph would synchronise the device first (and
            # so wait for the snapshot copy this test keeps in flight)
            self.graph.capture_begin()
            try:
                self.copy()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)

    def copy(self) -> None:
        with torch.no_grad():
            for t, s in zip(self.state, self.src):
                t.copy_(s)

    def refill(self, step: int) -> None:
        """New values into the sources (stream-ordered host-to-device copies)."""
        for i, s in enumerate(self.src):
            s.copy_(pattern(tuple(s.shape), 50 + i, step).view(s.dtype))


def make(snap_env: Any) -> tuple[Any, Any, Any]:
    import cudasnap

    model, opt = build()
    opt.step()  # the optimizer's state exists before the capture
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    snap.boundary(0)
    assert snap.wait(timeout=60)
    return model, opt, snap


def test_capture_while_copying_then_fenced_replays_snapshot_bitwise(snap_env: Any, emu: Any
                                                                    ) -> None:
    model, opt, snap = make(snap_env)
    try:
        emu.hold(parts.cuda(snap).engine.copy_stream)
        try:
            snap.boundary(1)  # a copy in flight (held) during the whole capture
            assert parts.cuda(snap).engine.busy
            step = GraphStep(snap)  # raises if the capture was invalidated
            assert parts.cuda(snap).engine.busy
        finally:
            emu.release()
        assert snap.wait(timeout=60)
        for i in range(2, 6):
            step.refill(i)
            snap.fence()  # the documented call before a graph replay writes the state
            step.graph.replay()
            want = state_bytes(snap)
            parts.cuda(snap).engine.set_test_copy_delay_us(20_000)  # the copy starts late
            snap.boundary(i)
            step.refill(1000 + i)
            snap.fence()
            step.graph.replay()  # the next step's writes: behind the copy of step i
            assert snap.wait(timeout=60)
            info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
            assert info["step"] == i
            assert diff(got, want) == [], f"step {i}: the replay overtook the copy"
            assert diff(state_bytes(snap), want) != []  # and the replay did write
        assert emu.counter("captures") == 0
    finally:
        parts.cuda(snap).engine.set_test_copy_delay_us(0)
        snap.close()


def test_replay_without_the_fence_tears_the_snapshot(snap_env: Any, emu: Any) -> None:
    """Negative control: the replay, not fenced, lands before the held copy."""
    model, opt, snap = make(snap_env)
    try:
        step = GraphStep(snap)
        step.refill(7)
        step.graph.replay()
        want = state_bytes(snap)
        emu.hold(parts.cuda(snap).engine.copy_stream)
        try:
            snap.boundary(1)
            step.refill(8)
            step.graph.replay()  # no snap.fence()
            torch.cuda.current_stream().synchronize()
        finally:
            emu.release()
        assert snap.wait(timeout=60)
        info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert info["step"] == 1
        assert sorted(diff(got, want)) == sorted(want)
    finally:
        snap.close()
