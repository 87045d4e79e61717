"""The orderings the product exists to get right, each deterministic under the emulator.

On a GPU the optimizer step's kernels are still queued on the compute stream when
``boundary()`` returns, and the next step's kernels are queued while the snapshot still
copies. Here a stream is *held* (it runs nothing more) or stopped at a *hold point* (after
a copy's phase 0), and released the moment something waits for it
(``Emu.release_when``): a correct ordering makes some stream or thread wait, a broken one
lets the code under test run on, and the slot then holds the wrong bytes. The release
watches one named stream (``waiter=``: stopped at a wait), never a count that unrelated
device-wide synchronisation could raise. Nothing depends on timing: while a stream is
held no work of it moves. Each test is paired with the
mutant of tools/cudaemu/mutants.py that it must catch.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from emu_train import build, diff, pattern, state_bytes, train_step
from helpers import parts
from helpers.slots import read_slot


def make_snap(snap_env: Any, model: Any, opt: Any) -> Any:
    import cudasnap

    return cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)


def started(snap_env: Any, split: bool = False) -> tuple[Any, Any, Any]:
    """A Snapshotter past its first boundary (the engine and the arena exist).
    ``split``: the forward's buffer in a segment of its own (2.4 MB: the caching
    allocator's large pool), so that the copy's phase 0 (buffers) and phase 1
    (parameters, optimizer state) are separate copies, with a hold point between."""
    model, opt = build()
    if split:
        model.stat = pattern((600_000,), 3, 0).cuda()
    snap = make_snap(snap_env, model, opt)
    train_step(model, opt, 0)
    snap.boundary(0)
    assert snap.wait(timeout=60)
    return model, opt, snap


def newest_slot(snap: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return read_slot(parts.arena(snap), parts.arena(snap).newest_complete())


def slot_diff(snap: Any, step: int, want: dict[str, torch.Tensor]) -> list[str]:
    """Once the copy is COMPLETE: the tensors of the newest slot (of ``step``) that differ
    from ``want``."""
    assert snap.wait(timeout=60)
    info, got = newest_slot(snap)
    assert info["step"] == step
    return diff(got, want)


def test_the_copy_waits_for_compute_queued_before_the_boundary(snap_env: Any, emu: Any) -> None:
    """The optimizer step's writes are still queued (compute stream held) when boundary()
    submits the copy: the copy stream must wait for them (the `ready` event).
    Mutant: ``no-ready-wait``."""
    model, opt, snap = started(snap_env)
    try:
        train_step(model, opt, 1)
        compute = torch.cuda.current_stream()
        # The step's writes as a GPU runs them: asynchronous, from pinned memory.
        src = [pattern(tuple(p.shape), 70 + i, 1).pin_memory() for i, p in
               enumerate(model.parameters())]
        emu.hold(compute.cuda_stream)
        returned = threading.Event()
        t = emu.release_when(compute.cuda_stream, returned.is_set,
                             waiter=parts.cuda(snap).engine.copy_stream)
        with torch.no_grad():
            for p, s in zip(model.parameters(), src):
                p.copy_(s, non_blocking=True)  # queued behind the hold
        snap.boundary(1)
        assert snap.wait(timeout=60)
        returned.set()
        t.join(60)
        want = state_bytes(snap)  # the live state now: the step's writes have run
        bad = slot_diff(snap, 1, want)
        assert not bad, f"the copy ran before the queued step: {bad}"
        assert t.blocked, "the copy stream did not wait for the held compute stream"
    finally:
        emu.release()
        snap.close()


def test_the_next_step_waits_for_phase_1_of_the_copy(snap_env: Any, emu: Any) -> None:
    """The copy stops after phase 0 (buffers); the next forward may run (its buffer is
    copied), the next optimizer step must wait for the parameters' copy (`done`).
    Mutants: ``no-step-fence``, ``done-before-phase-1``, ``fence-without-wait``."""
    model, opt, snap = started(snap_env, split=True)
    try:
        train_step(model, opt, 1)
        want = state_bytes(snap)
        copy = parts.cuda(snap).engine.copy_stream
        emu.hold_at(copy, 1)  # phase 0 is one range (Net.stat): the hold point is after it
        snap.boundary(1)
        assert parts.cuda(snap).engine.last_memcpy_calls >= 2, "phase 0 and 1 were not apart"
        # Phase 0 copied and its event recorded before the step runs: the forward's fence
        # then waits for nothing, and only the optimizer step's fence can stop the stream.
        emu.wait_parked(copy)
        stepped = threading.Event()
        t = emu.release_when(copy, stepped.is_set,
                             waiter=torch.cuda.current_stream().cuda_stream)
        train_step(model, opt, 1001)  # forward (phase 0 is copied) then optimizer step
        stepped.set()
        t.join(60)
        bad = slot_diff(snap, 1, want)
        assert not bad, f"the step overtook the copy: {bad}"
        assert t.blocked, "the optimizer step did not wait for the copy"
    finally:
        emu.release()
        snap.close()


def test_compute_after_the_boundary_does_not_wait_for_the_copy(snap_env: Any, emu: Any) -> None:
    """Overlap: work that writes no snapshotted state runs while the copy is held (the
    copy stream must not be a blocking stream that the legacy default stream joins).
    Mutant: ``blocking-copy-stream``."""
    model, opt, snap = started(snap_env)
    try:
        other = torch.zeros(1024, device="cuda")
        train_step(model, opt, 1)
        copy = parts.cuda(snap).engine.copy_stream
        emu.hold(copy)
        snap.boundary(1)
        wrote = threading.Event()
        t = emu.release_when(copy, wrote.is_set, waiter=torch.cuda.current_stream().cuda_stream)
        other.copy_(torch.full((1024,), 7.0))  # a forward's activations, say
        wrote.set()
        t.join(60)
        assert snap.wait(timeout=60)
        assert not t.blocked, "compute waited for the snapshot copy: no overlap"
        assert torch.equal(other.cpu(), torch.full((1024,), 7.0))
    finally:
        emu.release()
        snap.close()


def test_kernels_that_take_time_keep_the_step_queued_at_the_boundary(
        snap_env: Any, emu: Any) -> None:
    """Smoke: with kernels that take time (CUDAEMU_KERNEL_US / kernel_us), torch's own
    launches are still running when boundary() submits (they write no snapshotted state:
    the orderings are decided by the tests above); every snapshot equals the state at
    its boundary."""
    model, opt, snap = started(snap_env)
    try:
        emu.fault("kernel_us:20000")
        for i in range(1, 4):
            train_step(model, opt, i)
            want = state_bytes(snap)
            x = torch.empty(16, device="cuda")
            for _ in range(5):
                x.add_(1)  # 5 kernels of 20 ms queued ahead of the boundary
            snap.boundary(i)
            train_step(model, opt, 1000 + i)
            assert not slot_diff(snap, i, want)
    finally:
        emu.fault("kernel_us:0")
        snap.close()


# ------------------------------------------------------------ side streams
@pytest.mark.parametrize("registered", [True, False])
def test_a_step_queued_on_a_side_stream_before_the_boundary(snap_env: Any, emu: Any,
                                                            registered: bool) -> None:
    """The optimizer step ran on a user stream and is still queued there (held) when
    boundary() is called on the default stream. With ``add_writer_stream`` the copy
    waits for it; without (negative control) the copy runs ahead and the slot holds
    the state from before the step."""
    model, opt, snap = started(snap_env)
    side = torch.cuda.Stream()
    if registered:
        snap.add_writer_stream(side)
    try:
        train_step(model, opt, 1)
        side.wait_stream(torch.cuda.current_stream())
        src = [pattern(tuple(p.shape), 80 + i, 1).pin_memory() for i, p in
               enumerate(model.parameters())]
        emu.hold(side.cuda_stream)
        returned = threading.Event()
        t = emu.release_when(side.cuda_stream, returned.is_set,
                             waiter=parts.cuda(snap).engine.copy_stream)
        with torch.cuda.stream(side), torch.no_grad():
            for p, s in zip(model.parameters(), src):
                p.copy_(s, non_blocking=True)  # the step's writes, queued behind the hold
        snap.boundary(1)  # on the default stream
        assert snap.wait(timeout=60)
        returned.set()
        t.join(60)
        torch.cuda.synchronize()
        want = state_bytes(snap)  # the state after the side stream's step
        bad = slot_diff(snap, 1, want)
        if registered:
            assert t.blocked and not bad, bad
        else:
            assert not t.blocked and bad, "the copy waited for an unknown stream"
    finally:
        emu.release()
        snap.close()


@pytest.mark.parametrize("registered", [True, False])
def test_a_graph_replayed_on_a_side_stream_after_the_fence(snap_env: Any, emu: Any,
                                                           registered: bool) -> None:
    """A captured step replayed on a side stream while the copy is held, after the
    documented ``snap.fence()`` on the default stream. With ``add_writer_stream`` the
    side stream waits for the copy; without (negative control) the replay overtakes it."""
    from test_cuda_graph_step import GraphStep

    model, opt, snap = started(snap_env)
    side = torch.cuda.Stream()
    if registered:
        snap.add_writer_stream(side)
    try:
        step = GraphStep(snap)
        step.refill(7)
        step.graph.replay()
        want = state_bytes(snap)
        copy = parts.cuda(snap).engine.copy_stream
        emu.hold(copy)
        snap.boundary(1)
        step.refill(8)
        snap.fence()  # on the default stream (which then waits: not what is tested)
        replayed = threading.Event()
        t = emu.release_when(copy, replayed.is_set, waiter=side.cuda_stream)
        with torch.cuda.stream(side):
            step.graph.replay()
        side.synchronize()
        replayed.set()
        t.join(60)
        bad = slot_diff(snap, 1, want)
        if registered:
            assert t.blocked and not bad, bad
        else:
            assert not t.blocked and sorted(bad) == sorted(want)
    finally:
        emu.release()
        snap.close()


def test_a_writer_stream_must_be_a_cuda_stream(snap_env: Any, emu: Any) -> None:
    model, opt, snap = started(snap_env)
    try:
        with pytest.raises(TypeError, match="torch.cuda.Stream"):
            snap.add_writer_stream(object())
    finally:
        snap.close()
