"""Snapshot-then-offload (``device_staging=``): the orderings it adds, deterministic under
the emulator (the holds of tests/cuda_emu/test_ordering.py).

With a device staging buffer the copy stream first copies the state device-to-device
into it, records ``done`` (the fences wait for that only), then drains the buffer to the
host. So: the next optimizer step waits for the device copy; it does NOT wait for the
drain, and the drain still delivers the boundary's bytes (the buffer holds them, not
the live state the step rewrote); COMPLETE comes only once the drain has landed. Each
test is paired with the mutant of tools/cudaemu/mutants.py that it must catch.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from emu_train import build, diff, state_bytes, train_step
from helpers import parts
from helpers.slots import read_slot


def started(snap_env: Any) -> tuple[Any, Any, Any]:
    """A Snapshotter with a device staging buffer larger than the state, past its first
    boundary (engine, arena and buffer exist). One 4 MiB chunk holds the whole state: the
    drain has no progress mark, so its end alone lets the checksum and the commit go (with
    the automatic chunk of this small state, marks inside a held drain would keep the
    commit back even where the end of the drain is not waited for)."""
    import cudasnap

    model, opt = build()
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False, device_staging=64 << 20, overhead_budget=0.0,
                                chunk_bytes=4 << 20)
    train_step(model, opt, 0)
    snap.boundary(0)
    assert snap.wait(timeout=60)
    st = snap.stats()
    assert st["last_staged_bytes"] > 0 and st["device_staging_bytes"] >= st["last_staged_bytes"]
    return model, opt, snap


def slot_diff(snap: Any, step: int, want: dict[str, torch.Tensor]) -> list[str]:
    assert snap.wait(timeout=60)
    info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
    assert info["step"] == step
    return diff(got, want)


def test_staged_the_next_step_waits_for_the_device_copy(snap_env: Any, emu: Any) -> None:
    """The copy stream is held before its device-to-device copy: the next optimizer step
    must wait (its fence: ``done``, recorded after the device copy).
    Mutants: ``done-before-phase-1``, ``done-on-compute-stream``."""
    model, opt, snap = started(snap_env)
    try:
        train_step(model, opt, 1)
        want = state_bytes(snap)
        copy = parts.cuda(snap).engine.copy_stream
        emu.hold(copy)
        snap.boundary(1)
        stepped = threading.Event()
        t = emu.release_when(copy, stepped.is_set, waiter=torch.cuda.current_stream().cuda_stream)
        train_step(model, opt, 1001)
        stepped.set()
        t.join(60)
        bad = slot_diff(snap, 1, want)
        assert not bad, f"the step overtook the device copy: {bad}"
        assert t.blocked, "the optimizer step did not wait for the device copy"
    finally:
        emu.release()
        snap.close()


def test_staged_the_step_runs_during_the_drain_which_keeps_the_boundarys_bytes(
        snap_env: Any, emu: Any) -> None:
    """The copy stream stops after the device copy, before the drain: the next optimizer
    step runs at once (it waits for nothing held), rewriting the live state; the snapshot
    is not COMPLETE while the drain is held, and once it has drained it holds the
    boundary's bytes. Mutants: ``staged-fence-on-drain``, ``staged-commit-before-drain``."""
    model, opt, snap = started(snap_env)
    try:
        train_step(model, opt, 1)
        want = state_bytes(snap)
        copy = parts.cuda(snap).engine.copy_stream
        # the device copies: one per device range of the plan (all staged), then the drain
        emu.hold_at(copy, snap.stats()["layout"]["copy_ranges"])
        snap.boundary(1)
        emu.wait_parked(copy)
        # forward + optimizer step while the drain is held (on a thread: a step that waits
        # for the drain blocks its host at the next synchronous copy; nothing held moves,
        # so a step that does not wait is done long before the bound)
        step = threading.Thread(target=train_step, args=(model, opt, 1001), daemon=True)
        step.start()
        step.join(30)
        assert not step.is_alive(), "the optimizer step waited for the drain to the host"
        torch.cuda.current_stream().synchronize()  # its queued writes have run too
        assert emu.parked(copy), "the drain was not held"
        assert diff(state_bytes(snap), want), "the step did not rewrite the live state"
        # A commit before the drain would come within this wait.
        assert not snap.wait(timeout=2.0), "COMPLETE before the drain landed"
        emu.release()
        bad = slot_diff(snap, 1, want)
        assert not bad, f"the drain did not deliver the boundary's bytes: {bad}"
    finally:
        emu.release()
        snap.close()


@pytest.mark.parametrize("staging", [0, 64 << 20, 4096 + 100, 200_000])
def test_staged_slots_hold_cpu_tensors_and_the_unstaged_rest(snap_env: Any, emu: Any,
                                                             staging: int) -> None:
    """CPU tensors in the state (Adam's ``step``) are written into the slot at submit and
    never pass through the device buffer: the drain must not copy the buffer over them.
    The buffer holding all of the state, none of it, and part of it (unaligned), each
    with the slot checked byte for byte and its checksums verified (read_slot)."""
    import cudasnap

    model, opt = build()
    train_step(model, opt, 0)
    for p in model.parameters():
        opt.state[p]["step"] = torch.full((1000,), 7.0)  # a CPU tensor of the state
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False, device_staging=staging, overhead_budget=0.0)
    try:
        snap.boundary(0)
        assert snap.wait(timeout=60)
        train_step(model, opt, 1)
        for p in model.parameters():
            opt.state[p]["step"].fill_(9.0)
        want = state_bytes(snap)
        snap.boundary(1)
        assert snap.wait(timeout=60)
        staged = snap.stats()["last_staged_bytes"]
        assert (0 < staged <= staging) if staging else staged == 0, staged
        info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert info["step"] == 1
        assert diff(got, want) == []
    finally:
        snap.close()
