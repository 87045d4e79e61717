"""A restore from an arena slot holds the background arena set-up (issue 15 target 6a).

The pre-fault of an adopted arena (``Arena.prefault`` on the preparer thread) would
run beside a restore on the same cores and the same mmap lock. ``CancelFlag.pause()``
holds it at its next piece; ``resume()`` lets it go on where it stopped, so the arena
still ends up fully prepared. Shown by set-ups that cannot finish while held (they
would finish in milliseconds otherwise), never by a wall-clock speed bound.
"""
from __future__ import annotations

import threading

import pytest
import torch
from helpers import parts

import cudasnap
from cudasnap._native import native
from cudasnap._testing import arena_gate
from cudasnap.core import arena_preparer
from cudasnap.errors import StagingError
from tools.faults.trainlib import adam_step as _step
from tools.faults.trainlib import small_adam as _adam

CHUNK = 64 << 10
HELD_S = 0.3  # far longer than an 8 MiB pre-fault takes, even on a loaded machine


def _prefault_on_a_thread(arena, flag):
    out: dict[str, BaseException] = {}

    def run():
        try:
            arena.prefault(flag)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_paused_prefault_waits_and_resumes(snap_env):
    C = native()
    path = snap_env.scratch_arena("pause")
    a = C.Arena.create(str(path), 2, 8 << 20, 1 << 16, CHUNK, "j", False)
    try:
        flag = C.CancelFlag()
        flag.pause()
        flag.pause()  # nested: two resumes needed
        assert flag.paused
        t, out = _prefault_on_a_thread(a, flag)
        t.join(HELD_S)
        assert t.is_alive(), "the pre-fault ran on while paused"
        flag.resume()
        t.join(HELD_S)
        assert t.is_alive(), "one resume() ended two pauses"
        flag.resume()
        assert not flag.paused
        t.join(60)
        assert not t.is_alive() and not out
        flag.resume()  # an extra resume never makes the count negative
        flag.pause()
        assert flag.paused
    finally:
        a.unlink()


def test_cancel_ends_a_pause(snap_env):
    C = native()
    path = snap_env.scratch_arena("pausecancel")
    a = C.Arena.create(str(path), 2, 8 << 20, 1 << 16, CHUNK, "j", False)
    try:
        flag = C.CancelFlag()
        flag.pause()
        t, out = _prefault_on_a_thread(a, flag)
        t.join(HELD_S)
        assert t.is_alive()
        flag.set()
        t.join(60)
        assert not t.is_alive()
        assert isinstance(out.get("err"), StagingError) and "cancelled" in str(out["err"])
    finally:
        a.unlink()


def _snap(env, model, opt):
    return cudasnap.Snapshotter(model, opt, directory=env.dir, copy_threads=1,
                                chunk_bytes=CHUNK, arena_sync_max_bytes=0)


def _leave_a_snapshot(env):
    model, opt = _adam(seed=0)
    snap = _snap(env, model, opt)
    try:
        assert snap.arena_ready(60)
        _step(model, opt)
        snap.boundary(0)
        _step(model, opt)
        snap.boundary(1)
        assert snap.wait(60) and snap.stats()["snapshots"] == 2
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        snap.close(keep_arena=True, flush=False)


@pytest.mark.parametrize("damaged", [False, True])
def test_restore_from_a_slot_holds_the_preparer_then_lets_it_finish(snap_env, monkeypatch,
                                                                     damaged):
    want = _leave_a_snapshot(snap_env)
    if damaged:  # the newest slot's first chunk: restore falls back to the older slot
        a = native().Arena.open(str(snap_env.arena_path()), True, False)
        newest = a.newest_complete()
        view = a.data_view(newest, 16)
        view[3] ^= 0xFF
        del view, a
    gate = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", gate)
    model, opt = _adam(seed=1)
    snap = _snap(snap_env, model, opt)
    seen: list[bool] = []
    inner = parts.restore_slot(snap)

    def spy(arena, slot, where):
        seen.append(parts.prep_paused(snap))
        gate.set()  # the held set-up may start now: it must still wait for the restore
        return inner(arena, slot, where)

    parts.replace_restore_slot(monkeypatch, snap, spy)
    try:
        assert parts.prep(snap).busy  # the inherited arena's pre-fault, in the background
        got = snap.restore_latest()
        assert got == (1 if damaged else 2)
        assert seen and all(seen), "a slot was read while the arena set-up ran on"
        assert not parts.prep_paused(snap), "the set-up is still held after the restore"
        if not damaged:
            for k, v in model.state_dict().items():
                assert torch.equal(v, want[k]), k
        assert snap.arena_ready(60)  # the pre-fault went on and finished
        _step(model, opt)
        snap.boundary(got)  # adopts the prepared arena: snapshotted, not skipped
        assert snap.wait(60)
        st = snap.stats()
        assert st["snapshots"] == 1 and st["skipped_not_ready"] == 0
    finally:
        snap.close()


def test_paused_without_a_running_set_up_is_a_no_op():
    prep = arena_preparer.ArenaPreparer(0, None)
    with prep.paused() as held:
        assert held is False
