"""A restore from disk holds the background arena set-up, as a restore from a slot does
(issue 26: the pre-fault of a fresh arena beside it halved the disk restore's speed,
1.68 s against torch.load's 0.85 s for 1 GB; bench/snapshot_cpu.py measures it)."""
from __future__ import annotations

import threading

import torch
from helpers import parts

import cudasnap
from cudasnap import storage
from cudasnap._testing import arena_gate
from cudasnap.core import file_copy
from tools.faults.trainlib import adam_step as _step
from tools.faults.trainlib import small_adam as _adam

CHUNK = 64 << 10


def test_restore_from_disk_holds_the_preparer_then_lets_it_finish(snap_env, monkeypatch):
    model, opt = _adam(seed=0)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, copy_threads=1,
                                chunk_bytes=CHUNK, arena_sync_max_bytes=0)
    try:
        assert snap.arena_ready(60)
        _step(model, opt)
        snap.boundary(0)
        assert snap.wait(60)
        snap.flush()
        want = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        snap.close(flush=False)  # the arena goes: the restore reads the disk
    gate = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", gate)
    model, opt = _adam(seed=1)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, copy_threads=1,
                                chunk_bytes=CHUNK, arena_sync_max_bytes=0)
    seen: list[bool] = []
    opened = storage.PosixStorage.open_data  # what Restorer.restore_dir reads data.bin through

    def spy(*a, **kw):
        seen.append(parts.prep_paused(snap))
        gate.set()  # the held set-up may start now: it must still wait for the restore
        return opened(*a, **kw)

    monkeypatch.setattr(storage.PosixStorage, "open_data", spy)
    scatter = file_copy.run_plan  # the reads themselves: chunk by chunk, in the apply

    def scatter_spy(*a, **kw):
        seen.append(parts.prep_paused(snap))
        return scatter(*a, **kw)

    monkeypatch.setattr(file_copy, "run_plan", scatter_spy)
    try:
        assert parts.prep(snap).busy  # the new arena's set-up, in the background
        assert snap.restore_latest() == 1
        assert (snap.stats().get("restore") or {}).get("source") == "disk"
        assert len(seen) == 2 and all(seen), "data.bin was read while the arena set-up ran on"
        assert not parts.prep_paused(snap), "the set-up is still held after the restore"
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), k
        assert snap.arena_ready(60)  # the set-up went on and finished
    finally:
        gate.set()
        snap.close(flush=False)
