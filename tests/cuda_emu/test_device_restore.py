"""Restore from disk to the GPU through page-locked chunks (issue 34 item 5,
``_C.read_file_to_device``, ``csrc/cuda/device_sink.cpp``), under the emulator.

The file is read chunk by chunk into page-locked buffers, each chunk's CRC32C checked
before any byte of it is copied, and the chunk's bytes go to the device by DMA while the
next chunk is read. What must hold: the bytes land exactly; a bad chunk is never copied
and the restore falls back to the older snapshot; a buffer is not read into again while
a copy from it is still queued (the ``restore-no-buffer-wait`` mutant).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from emu_train import build, diff, state_bytes, train_step

CHUNK = 64 << 10  # small chunks: the state spans several (and several buffers per reader)


def snapshotter(model: Any, opt: Any, snap_env: Any, job: str) -> Any:
    import cudasnap

    return cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=job, health=False,
                                chunk_bytes=CHUNK, overhead_budget=0.0)


def flushed(snap_env: Any, steps: list[int]) -> list[dict[str, torch.Tensor]]:
    """Trains, flushing after each step in ``steps``; returns the state at each flush.
    The arena is removed: only the disk copies are left."""
    model, opt = build()
    snap = snapshotter(model, opt, snap_env, snap_env.job)
    wants = []
    try:
        for i in range(max(steps) + 1):
            train_step(model, opt, i)
            snap.boundary(i)
            if i in steps:
                assert snap.wait(timeout=60)
                wants.append(state_bytes(snap))
                assert snap.flush() is not None
    finally:
        snap.close(flush=False)
    for p in snap_env.arena_files():
        p.unlink()
    return wants


def restore(snap_env: Any, emu: Any) -> tuple[int, dict[str, torch.Tensor], dict[str, int]]:
    model, opt = build(seed=7)  # other bytes everywhere
    train_step(model, opt, 100)  # the optimizer's state exists, as in a resumed job
    snap = snapshotter(model, opt, snap_env, snap_env.job + "-b")
    calls = ("cudaHostAlloc", "cudaMemcpyAsync")
    before = {c: emu.counter(c) for c in calls}
    try:
        start = snap.restore_latest()
        got = state_bytes(snap)
        assert snap.stats()["restore"]["source"] == "disk"
    finally:
        snap.close(flush=False)
    return start, got, {c: emu.counter(c) - before[c] for c in calls}


def test_a_restore_from_disk_lands_on_the_device_through_pinned_chunks(
        snap_env: Any, emu: Any) -> None:
    (want,) = flushed(snap_env, [2])
    start, got, calls = restore(snap_env, emu)
    assert start == 3
    assert diff(got, want) == []
    # page-locked read buffers, and one DMA per piece of a tensor in a chunk
    assert calls["cudaHostAlloc"] >= 1, calls
    assert calls["cudaMemcpyAsync"] >= len(want), calls


def test_a_bad_chunk_is_not_copied_and_the_older_snapshot_loads(snap_env: Any, emu: Any) -> None:
    older, newer = flushed(snap_env, [2, 5])
    data = Path(snap_env.dir) / "step-00000005" / "data.bin"
    raw = bytearray(data.read_bytes())
    assert len(raw) > 3 * CHUNK
    raw[2 * CHUNK + 100] ^= 0xFF  # chunk 2: chunks 0 and 1 are copied before it fails
    data.chmod(0o600)
    data.write_bytes(bytes(raw))
    start, got, _ = restore(snap_env, emu)
    assert start == 3, "the corrupt snapshot was not skipped"
    assert diff(got, older) == []  # all of it: nothing of the newer one is left


def test_a_read_buffer_waits_for_the_copies_from_it(snap_env: Any, emu: Any) -> None:
    """Every device copy is held up (copy_delay_us): a reader that read the next units
    into a buffer whose copies are still queued would overwrite their bytes before they
    are copied. Mutant: ``restore-no-buffer-wait``."""
    (want,) = flushed(snap_env, [2])
    emu.fault("copy_delay_us:150000")
    try:
        start, got, _ = restore(snap_env, emu)
    finally:
        emu.fault("copy_delay_us:0")
    assert start == 3
    assert diff(got, want) == [], "a read buffer was reused while a copy from it was queued"


def test_the_restore_lands_after_work_queued_on_the_tensors(snap_env: Any, emu: Any) -> None:
    """Work still queued for the live tensors when the restore starts (an init's kernels
    behind a long one, the last optimizer step before a rollback) runs before the
    restore's copies: the restored bytes are the ones left, as with torch's copy_ on the
    current stream (the restore's own streams must not overtake it)."""
    (want,) = flushed(snap_env, [2])
    model, opt = build(seed=7)
    train_step(model, opt, 100)
    snap = snapshotter(model, opt, snap_env, snap_env.job + "-b")
    try:
        emu.busy(torch.cuda.current_stream().cuda_stream, 1_500_000)  # a long kernel
        junk = torch.full(tuple(model.w.shape), -1.0).pin_memory()
        with torch.no_grad():
            model.w.copy_(junk, non_blocking=True)  # queued behind it, as an init's write
        assert snap.restore_latest() == 3
        assert diff(state_bytes(snap), want) == [], "queued work overwrote the restore"
    finally:
        snap.close(flush=False)
