"""Issue 21 item 8: the copy stream reads the state by address, so every storage of
the copy plan stays allocated until the copy can no longer read it.

* A state tensor swapped (``p.data = ...``, ``set_()``, a replaced optimizer state)
  right after ``boundary()`` gives its block back to the caching allocator only
  after the job is COMPLETE: a new tensor cannot take that block and be written
  while the DMA still reads it (the CRC, taken after the DMA, would make that torn
  copy verify).
* A failed job (here: its completion wait timed out, the GPU "hung") whose DMA is
  still queued keeps its storages until the engine has drained it (a later
  COMPLETE job, stream-ordered after it), not just until the job is retired.

The copy is held back on the copy stream (the engine's test delay, plus the
emulator's per-copy delay) so it certainly overlaps what follows ``boundary()``.
"""
from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from helpers import parts
from helpers.slots import read_slot
from torch.multiprocessing.reductions import StorageWeakRef

from cudasnap import Snapshotter
from cudasnap.errors import SnapshotError


def _fill(t: torch.Tensor, v: float) -> None:
    t.copy_(torch.full(t.shape, v, dtype=t.dtype))  # kernels are no-ops: host-to-device


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i, p in enumerate(model.parameters()):  # Adam's state, made by hand (no kernels)
        st = opt.state[p]
        st["step"] = torch.tensor(1.0)
        st["exp_avg"], st["exp_avg_sq"] = torch.empty_like(p), torch.empty_like(p)
        _fill(st["exp_avg"], 10.0 + i)
        _fill(st["exp_avg_sq"], 20.0 + i)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            _fill(p, 1.0 + i)
    return model, opt


def _snap(env: Any, model: torch.nn.Module, opt: Any) -> Snapshotter:
    return Snapshotter(model, opt, directory=env.dir, health=False, flush_on_close=False)


def _slot_bytes(arena: Any, slot: int) -> tuple[int, dict[str, bytes]]:
    """(step, name -> bytes) of a COMPLETE slot, CRC-checked."""
    info, raw = read_slot(arena, slot)
    return info["meta_step"], {k: bytes(v.numpy()) for k, v in raw.items()}


def _live_bytes(snap: Snapshotter) -> dict[str, bytes]:
    return {lt.name: bytes(lt.tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            for lt in snap.state.live_tensors()}


def _swap(model: torch.nn.Module, opt: Any, how: str) -> list[torch.Tensor]:
    """Replaces every parameter's (or optimizer state's) storage, then at once allocates
    a tensor of the same size and writes it: with the old block freed, the caching
    allocator hands exactly that block to the new tensor. Returns the new tensors."""
    junk = []
    for p in model.parameters():
        if how == "data":
            p.data = torch.empty_like(p)
            t = p
        elif how == "set_":
            with torch.no_grad():
                p.set_(torch.empty_like(p))
            t = p
        else:  # an optimizer that swaps a state tensor
            opt.state[p]["exp_avg"] = torch.empty_like(p)
            t = opt.state[p]["exp_avg"]
        x = torch.empty_like(t)  # the freed block, were nothing holding it
        _fill(x, 99.0)
        junk.append(x)
    return junk


@pytest.mark.parametrize("how", ["data", "set_", "optim_state"])
def test_swapped_storage_stays_held_until_complete(emu, snap_env, how):
    model, opt = _state()
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(1)
        assert snap.wait(30) and snap.arena_ready()
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                _fill(p, 5.0 + i)
        want = _live_bytes(snap)
        olds = {lt.name: (StorageWeakRef(lt.tensor.untyped_storage()),
                          lt.tensor.untyped_storage().data_ptr())
                for lt in snap.state.live_tensors()}
        emu.hold(parts.cuda(snap).engine.copy_stream)  # the copy waits until released
        try:
            snap.boundary(2)
            assert parts.job(snap) is not None and not parts.job(snap).done(1), "the copy is not in flight"
            junk = _swap(model, opt, how)
            assert not parts.job(snap).done(1), "the copy finished before the swap: nothing checked"
            now = {lt.name: lt.tensor.untyped_storage().data_ptr()
                   for lt in snap.state.live_tensors()}
            swapped = [n for n in olds if now[n] != olds[n][1]]
            assert len(swapped) == 2, swapped
            freed = [n for n in swapped if olds[n][0].expired()]
            reused = {x.data_ptr() for x in junk} & {olds[n][1] for n in swapped}
        finally:
            emu.release()
        assert snap.wait(30)
        step, got = _slot_bytes(parts.arena(snap), parts.arena(snap).newest_complete())
        assert step == 2
        bad = sorted(n for n in want if got[n] != want[n])
        assert bad == [], f"the COMPLETE slot does not hold the state at boundary(2): {bad}"
        # Held: nothing freed while the copy ran, so no new tensor took a planned block.
        assert freed == [] and not reused, (freed, reused)
        # COMPLETE: the old storages go once the layout that planned them is gone too.
        snap.boundary(3)  # the swap is found: a new plan
        assert snap.wait(30)
        gc.collect()
        assert [n for n in swapped if not olds[n][0].expired()] == []
    finally:
        snap.close()


def test_failed_copy_keeps_its_storages_until_the_engine_drained(emu, snap_env):
    model, opt = _state()
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(1)
        assert snap.wait(30) and snap.arena_ready()
        eng = parts.cuda(snap).engine
        eng.wait_timeout_s = 0.3
        emu.hold(eng.copy_stream)  # the DMA stays queued past the completion wait: "hung"
        try:
            snap.boundary(2)
            w = model.weight
            ref = StorageWeakRef(w.untyped_storage())
            with pytest.raises(SnapshotError, match="did not complete"):
                parts.job(snap).wait(1, 30)
            assert eng.hung, "the completion wait did not time out"
            w.data = torch.empty_like(w)
            snap.invalidate_layout()
            assert snap.wait(30)  # retires the failed job
            gc.collect()
            # Its DMA is still queued on the copy stream: the old storage must stay allocated.
            assert not ref.expired(), "a failed job's storages were freed while its DMA is queued"
            assert parts.layouts(snap).draining
        finally:
            emu.release()
        # A later COMPLETE job runs after that DMA on the copy stream: then it may go.
        eng.wait_timeout_s = 30.0
        snap.boundary(3)
        assert snap.wait(30)
        assert parts.arena(snap).slot_info(parts.arena(snap).newest_complete())["step"] == 3
        gc.collect()
        assert parts.layouts(snap).draining == () and ref.expired()
        from cudasnap import _C

        # close() leaves the arena of a once-hung engine registered: the next tests reuse.
        _C.unregister_arena(parts.arena(snap))
    finally:
        snap.close()


def test_close_on_a_hung_gpu_keeps_the_storages_its_dma_may_read(emu, snap_env):

    model, opt = _state()
    snap = _snap(snap_env, model, opt)
    closed = False
    try:
        snap.boundary(1)
        assert snap.wait(30) and snap.arena_ready()
        eng = parts.cuda(snap).engine
        eng.wait_timeout_s = 0.3
        emu.hold(eng.copy_stream)  # the DMA stays queued: the GPU is "hung"
        try:
            snap.boundary(2)
            w = model.weight
            ref = StorageWeakRef(w.untyped_storage())
            w.data = torch.empty_like(w)
            snap.invalidate_layout()
            before = len(parts.abandoned_fences())
            # The queued DMA still writes into the arena: keep it mapped (the emulator writes
            # through the virtual address; a real GPU's registration keeps the pages pinned).
            arena = parts.arena(snap)
            snap.close(keep_arena=True)  # the job fails (hung), then the engine stops
            closed = True
            gc.collect()
            assert eng.hung
            assert len(parts.abandoned_fences()) == before + 1 and not ref.expired()
            assert parts.layouts(snap).draining == () and parts.layouts(snap).running is None
        finally:
            emu.release()
        torch.cuda.synchronize()  # the DMA has run: let this test's layout and arena go
        del parts.abandoned_fences()[before:]
        from cudasnap import _C

        _C.unregister_arena(arena)  # close() left it registered (hung): later tests reuse
        arena.unlink()
        del arena
    finally:
        if not closed:
            snap.close()
