"""Issue 14, library side: the one-step promise during a flush, a durable close(),
fresh starts, and clear errors for bad input (steps, optimizers, a closed Snapshotter)."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import parts

import cudasnap
from cudasnap.errors import ConfigError, IncompatibleSnapshot, SnapshotError
from cudasnap.storage import posix
from tools.faults.trainlib import Job


def _snap(env, job, **kw):
    return cudasnap.Snapshotter(job.model, job.opt, directory=env.dir, extra=job.extra(),
                                copy_threads=1, **kw)


def _copy(job):
    return {k: v.clone() for k, v in job.tensors().items()}


def _equal_to(job, tensors):
    got = job.tensors()
    return sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())


def _restore(env, **kw):
    job = Job(dim=16)
    snap = _snap(env, job, **kw)
    try:
        start = snap.restore_latest()
        return job, start, snap.stats()["restore"]
    finally:
        snap.close(keep_arena=True, flush=False)


# ------------------------------------------------------------ item 1: flush lease

def test_newest_step_stays_snapshotted_while_a_flush_holds_a_slot(snap_env, monkeypatch):
    """A flush leases the slot it writes for its whole duration. The boundaries that run
    meanwhile must keep snapshotting (none skipped), so a process that dies during or
    right after the flush resumes at the newest step + 1 (replay <= 1 step)."""
    entered, go = threading.Event(), threading.Event()
    real = posix.write_slot

    def slow_write(*a, **kw):  # the flush is in progress (slot leased) until `go`
        entered.set()
        assert go.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(posix, "write_slot", slow_write)
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    seen = {}
    for step in range(3):
        job.step()
        snap.boundary(step)
        seen[step] = _copy(job)
    snap.wait()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("path", snap.flush()))
    t.start()
    try:
        assert entered.wait(30)
        arena = parts.arena(snap)
        leased = [i for i in range(arena.num_slots) if arena.leases(i)]
        assert len(leased) == 1 and arena.slot_info(leased[0])["step"] == 2
        for step in range(3, 8):
            job.step()
            snap.boundary(step)
            seen[step] = _copy(job)
            snap.wait()
            # the newest COMPLETE slot other than the leased one is this very step
            steps = [arena.slot_info(i)["step"] for i in range(arena.num_slots)
                     if i not in leased and arena.slot_info(i)["valid"]]
            assert max(steps) == step, (step, steps)
        assert snap.stats()["skipped"] == 0
    finally:
        go.set()
        t.join(60)
    assert out["path"].name == "step-00000002"
    st = snap.stats()
    assert st["arena_slots"] == 3 and st["spare_slot_bytes"] > 0, st
    snap.close(keep_arena=True, flush=False)  # "killed": the arena stays, no final flush
    job2, start, info = _restore(snap_env)
    assert start == 8 and info["source"] == "shm" and _equal_to(job2, seen[7])


def test_spare_slot_can_be_turned_off(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job, spare_slot=False)
    try:
        job.step()
        snap.boundary(0)
        snap.wait()
        assert parts.arena(snap).num_slots == 2 and snap.stats()["spare_slot_bytes"] == 0
    finally:
        snap.close()


# ------------------------------------------------------------ item 2: durable close

def test_clean_close_flushes_the_final_step_and_restart_resumes_from_disk(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    for step in range(5):
        job.step()
        snap.boundary(step)
    want = _copy(job)
    snap.close()
    assert not snap_env.arena_files()  # the arena is gone ...
    assert [s.step for s in posix.list_snapshots(snap_env.dir)] == [4]  # ... the state is not
    assert snap.stats()["flushes"] == 1
    job2, start, info = _restore(snap_env)
    assert start == 5 and info["source"] == "disk" and _equal_to(job2, want)


def test_close_does_not_flush_a_step_already_on_disk(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    for step in range(3):
        job.step()
        snap.boundary(step)
    snap.flush()
    snap.close()
    assert snap.stats()["flushes"] == 1
    assert [s.step for s in posix.list_snapshots(snap_env.dir)] == [2]


def test_flush_on_close_off(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job, flush_on_close=False)
    job.step()
    snap.boundary(0)
    snap.close()
    assert posix.list_snapshots(snap_env.dir) == [] and not snap_env.arena_files()


# ------------------------------------------------------------ item 6: fresh / resume log

def _leave_run(env, steps=4, flush_at=1):
    job = Job(dim=16)
    snap = _snap(env, job)
    for step in range(steps):
        job.step()
        snap.boundary(step)
        if step == flush_at:
            snap.flush()
    snap.close(keep_arena=True, flush=False)  # as if killed: disk step 1, shm step 3


def test_fresh_moves_old_snapshots_aside_and_starts_at_zero(snap_env, caplog):
    _leave_run(snap_env)
    with caplog.at_level(logging.WARNING, logger="cudasnap"):
        job, start, info = _restore(snap_env, fresh=True)
    assert start == 0 and info["source"] is None
    assert posix.list_snapshots(snap_env.dir) == [] and not snap_env.arena_files()
    old = [p for p in snap_env.dir.iterdir() if p.name.startswith(".old-")]
    assert len(old) == 1
    # Nothing deleted: the flushed step and the arena's newer step are both kept aside.
    assert sorted(s.step for s in posix.list_snapshots(old[0])) == [1, 3]
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fresh" in m and str(old[0]) in m for m in msgs), msgs


def test_fresh_from_environment(snap_env, monkeypatch):
    _leave_run(snap_env)
    monkeypatch.setenv("CUDASNAP_FRESH", "1")
    _, start, _ = _restore(snap_env)
    assert start == 0
    monkeypatch.delenv("CUDASNAP_FRESH")
    _, start, _ = _restore(snap_env)  # the moved-aside snapshots are not resumed from
    assert start == 0


def test_resume_warns_once_with_step_and_source(snap_env, caplog):
    _leave_run(snap_env)
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    try:
        with caplog.at_level(logging.WARNING, logger="cudasnap"):
            assert snap.restore_latest() == 4
            assert snap.restore_latest() == 4
    finally:
        snap.close(keep_arena=True, flush=False)
    msgs = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "resuming" in r.getMessage()]
    assert len(msgs) == 1 and "step 3" in msgs[0] and str(snap_env.arena_path()) in msgs[0], msgs


# ------------------------------------------------------------ bad input

def test_adamw_snapshot_into_sgd_names_both_classes(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    for step in range(2):
        job.step()
        snap.boundary(step)
    snap.close()
    job2 = Job(dim=16)
    job2.opt = torch.optim.SGD(job2.model.parameters(), lr=0.1, momentum=0.9)
    job2.sched = torch.optim.lr_scheduler.StepLR(job2.opt, step_size=3)
    snap2 = _snap(snap_env, job2)
    try:
        with pytest.raises(IncompatibleSnapshot,
                           match=r"optimizer 'optim' is AdamW in the snapshot but SGD here"):
            snap2.restore_latest()
    finally:
        snap2.close(flush=False)


def test_other_lr_scheduler_class_names_both(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    job.step()
    snap.boundary(0)
    snap.close()
    job2 = Job(dim=16)
    job2.sched = torch.optim.lr_scheduler.CosineAnnealingLR(job2.opt, T_max=10)
    snap2 = _snap(snap_env, job2)
    try:
        with pytest.raises(IncompatibleSnapshot,
                           match=r"extra 'sched' is StepLR in the snapshot but CosineAnnealingLR"):
            snap2.restore_latest()
    finally:
        snap2.close(flush=False)


def test_snapshot_without_optimizer_class_still_loads(snap_env, monkeypatch):
    """Snapshots written before the class was recorded have no 'class' field."""
    from cudasnap.core.state import TrainingState

    real = TrainingState.host_members  # what the boundary captures (capture_host's too)

    def old_format(self, optim=True):
        host = real(self, optim)
        for o in host.get("optim", {}).values():
            o.pop("class", None)
        for e in host["extra"].values():
            e.pop("class", None)
        return host

    monkeypatch.setattr(TrainingState, "host_members", old_format)
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    for step in range(2):
        job.step()
        snap.boundary(step)
    want = _copy(job)
    snap.close()
    newest = posix.list_snapshots(snap_env.dir)[-1]
    host = posix.load_manifest(newest.manifest_path)["host"]
    assert "class" not in repr(host["optim"]) + repr(host["extra"])  # the old format indeed
    job2, start, _ = _restore(snap_env)
    assert start == 2 and _equal_to(job2, want)


@pytest.mark.parametrize("bad,match", [
    (-5, r"boundary\(-5\).*negative"),
    (1.0, r"boundary\(1\.0\).*int"),
    (True, r"boundary\(True\).*int"),
])
def test_boundary_refuses_bad_steps(snap_env, bad, match):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    try:
        with pytest.raises(ConfigError, match=match):
            snap.boundary(bad)
        assert snap.stats()["snapshots"] == 0
    finally:
        snap.close()
    assert not any("--" in p.name for p in snap_env.dir.iterdir())


def test_boundary_steps_must_increase(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    try:
        job.step()
        snap.boundary(5)
        for again in (5, 3):
            with pytest.raises(ConfigError, match=rf"boundary\({again}\).*step 5"):
                snap.boundary(again)
        snap.boundary(np_int(6))  # numpy / torch integers are integers
    finally:
        snap.close()


def np_int(v):
    import numpy as np

    return np.int64(v)


def test_after_a_restore_steps_continue_above_the_restored_step(snap_env):
    _leave_run(snap_env)  # shm step 3
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    try:
        assert snap.restore_latest() == 4
        with pytest.raises(ConfigError, match=r"boundary\(2\).*restored step 3"):
            snap.boundary(2)
        snap.boundary(4)
        snap.wait()
        assert snap.rollback() == 5
        snap.boundary(5)
    finally:
        snap.close(flush=False)


@pytest.mark.parametrize("call", ["restore_latest", "flush", "rollback"])
def test_calls_after_close_raise_closed(snap_env, call):
    job = Job(dim=16)
    snap = _snap(snap_env, job)
    job.step()
    snap.boundary(0)
    snap.close()
    with pytest.raises(SnapshotError, match="closed"):
        getattr(snap, call)()


def test_keep_zero_keeps_everything_and_negative_is_refused(snap_env):
    job = Job(dim=16)
    snap = _snap(snap_env, job, keep=0)
    try:
        for step in range(5):
            job.step()
            snap.boundary(step)
            snap.flush()
    finally:
        snap.close()
    assert [s.step for s in posix.list_snapshots(snap_env.dir)] == [4, 3, 2, 1, 0]
    for bad in (-1, 1.5):
        with pytest.raises(ConfigError, match="keep"):
            _snap(snap_env, Job(dim=16), keep=bad)


def test_supervised_dir_mismatch_warns_and_does_not_take_the_supervisors_job(snap_env, monkeypatch,
                                                                            caplog):
    """`cudasnap run --dir A` around a script whose Snapshotter writes to B: the supervisor would
    flush A's arena name and the restart would read B. Warn once; B gets its own arena name."""
    import logging

    from cudasnap.snapshotter import Snapshotter

    other = snap_env.tmp / "supervisor-dir"
    other.mkdir()
    monkeypatch.setenv("CUDASNAP_SUPERVISED", "1")
    monkeypatch.setenv("CUDASNAP_DIR", str(other))
    model = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING, logger="cudasnap"):
        snap = Snapshotter(model, None, directory=snap_env.dir, backend="cpu", flush_on_close=False)
    try:
        msgs = [r.getMessage() for r in caplog.records if "cudasnap run --dir" in r.getMessage()]
        assert len(msgs) == 1, caplog.text
        assert str(other) in msgs[0] and str(snap_env.dir) in msgs[0]
        assert snap.job != snap_env.job  # not the supervisor's CUDASNAP_JOB
    finally:
        snap.close()


def test_supervised_same_dir_takes_the_supervisors_job(snap_env, monkeypatch, caplog):
    import logging

    from cudasnap.snapshotter import Snapshotter

    snap_env.dir.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("CUDASNAP_SUPERVISED", "1")
    monkeypatch.setenv("CUDASNAP_DIR", str(snap_env.dir))
    with caplog.at_level(logging.WARNING, logger="cudasnap"):
        snap = Snapshotter(torch.nn.Linear(4, 4), None, directory=snap_env.dir, backend="cpu",
                           flush_on_close=False)
    try:
        assert snap.job == snap_env.job
        assert "cudasnap run --dir" not in caplog.text
    finally:
        snap.close()
