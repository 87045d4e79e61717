"""The start of an attempt, before the staging arena is ready (issue 23 item 2), and the
arena a dying script leaves in /dev/shm (issue 23 item 6).

"Not ready" is made deterministic with ``cudasnap._testing.arena_gate`` (the
background set-up is held before its work until the test releases it) and
``arena_sync_max_bytes=0`` (every arena goes to the background preparer): never timing.

* a SIGKILL in a restart's window loses <= 1 step: the inherited arena takes the
  snapshots from the first boundary on (CPU), while its pre-fault is still held;
* SIGUSR1 (the guard's flush) before the arena is ready writes the current step: at a
  boundary, from the live state; mid-step, the step of the next boundary;
* ``flush()`` and ``close()`` before the arena is ready write the last step;
  ``close()`` with nothing of the run saved says so;
* a script dying of an exception names the arena it leaves, its size and `cudasnap gc`.

Run as a child: ``python tests/core/test_start_window.py leave|kill DIR``.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:  # tests/ (helpers) when run as a child
    sys.path.insert(0, _TESTS)

import pytest
import torch
from helpers import parts
from helpers.children import last_json, run_script

import cudasnap
from cudasnap._testing import arena_gate
from cudasnap.core import arena_exit
from cudasnap.core.copier import Copier
from cudasnap.storage import posix as store
from tools.faults.trainlib import adam_step as _step
from tools.faults.trainlib import small_adam as _adam

CHUNK = 64 << 10


def _snap(directory, model, opt, **kw):
    kw.setdefault("arena_sync_max_bytes", 0)
    return cudasnap.Snapshotter(model, opt, directory=directory, copy_threads=1,
                                chunk_bytes=CHUNK, **kw)


@pytest.fixture()
def gate(monkeypatch):
    ev = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", ev)
    yield ev
    ev.set()


def _disk_steps(env):
    return sorted(s.step for s in store.list_snapshots(env.dir))


def _state(model, opt):
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"o.{i}.{k}"] = v.clone()
    return out


def _restored(env, want, step):
    model, opt = _adam(seed=7)
    snap = _snap(env.dir, model, opt)
    try:
        assert snap.restore_latest() == step + 1  # the next step to run
        got = _state(model, opt)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    finally:
        snap.close(flush=False)


def _unready_run(env, steps, **kw):
    """A fresh attempt whose arena set-up is held: every boundary is skipped."""
    model, opt = _adam()
    snap = _snap(env.dir, model, opt, **kw)
    assert parts.prep(snap).busy and snap.stats()["arena_preparing"]
    for step in range(steps):
        _step(model, opt)
        snap.boundary(step)
    st = snap.stats()
    assert st["skipped_not_ready"] == steps and st["snapshots"] == 0
    return snap, model, opt


# ------------------------------------------------------------ close(), flush()
def test_close_before_the_arena_is_ready_writes_the_last_step(snap_env, gate):
    snap, model, opt = _unready_run(snap_env, 3)
    want = _state(model, opt)
    snap.close()
    assert _disk_steps(snap_env) == [2], "close() before the arena was ready wrote nothing"
    assert snap.stats()["early_saves"] == 1
    assert snap_env.arena_files() == []  # flushed: the arena went as usual
    _restored(snap_env, want, 2)


def test_flush_before_the_arena_is_ready_writes_the_current_step(snap_env, gate):
    snap, model, opt = _unready_run(snap_env, 3)
    try:
        want = _state(model, opt)
        path = snap.flush()
        assert path is not None and _disk_steps(snap_env) == [2]
        # the arena made for it takes the next boundaries (the held set-up was cancelled)
        _step(model, opt)
        snap.boundary(3)
        assert snap.wait(60)
        st = snap.stats()  # the live copy of step 2, then step 3's own
        assert st["snapshots"] == 2 and st["skipped_not_ready"] == 3
    finally:
        snap.close(flush=False)
    _restored(snap_env, want, 2)


def test_close_mid_step_with_nothing_saved_warns(snap_env, gate, caplog):
    caplog.set_level(logging.WARNING, logger="cudasnap")
    snap, model, opt = _unready_run(snap_env, 2)
    _step(model, opt)  # past step 1: the live state is no boundary's
    snap.close()
    assert _disk_steps(snap_env) == []
    lines = [r.getMessage() for r in caplog.records if "none of this run's" in r.getMessage()]
    assert len(lines) == 1 and "2 boundaries" in lines[0] and "last step 1" in lines[0], lines


def test_close_keep_arena_keeps_the_last_step_for_a_restart(snap_env, gate):
    snap, model, opt = _unready_run(snap_env, 3)
    want = _state(model, opt)
    snap.close(keep_arena=True)
    assert _disk_steps(snap_env) == [] and snap_env.arena_path().exists()
    _restored(snap_env, want, 2)


# ------------------------------------------------------------------- SIGUSR1
def _guarded(env, monkeypatch):
    monkeypatch.setenv("CUDASNAP_POLICY", "sigusr1=flush")
    return dict(health=True)


def _spy_flush(snap, monkeypatch):
    done = threading.Event()
    paths = []
    inner = snap.flush

    def flush(*a, **kw):
        try:
            paths.append(inner(*a, **kw))
        finally:
            done.set()
    monkeypatch.setattr(snap, "flush", flush)
    return done, paths


def test_sigusr1_at_a_boundary_before_the_arena_is_ready(snap_env, gate, monkeypatch):
    snap, model, opt = _unready_run(snap_env, 3, **_guarded(snap_env, monkeypatch))
    try:
        want = _state(model, opt)
        done, paths = _spy_flush(snap, monkeypatch)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert done.wait(120), "the SIGUSR1 flush did not run"
        assert paths and paths[0] is not None, "SIGUSR1 'completed' having saved nothing"
        assert _disk_steps(snap_env) == [2]
    finally:
        snap.close(flush=False)
    _restored(snap_env, want, 2)


def test_sigusr1_mid_step_before_the_arena_is_ready_writes_the_next_boundary(
        snap_env, gate, monkeypatch):
    """The flush waits until boundary(3) has handed over its copy, not only until it
    began: here the flush thread looks while boundary(3) is inside its copy hand-over
    (the timeline already at 3), which made it flush before the copy existed and write
    nothing (a flake under load before the wait compared EarlySaver.done_step)."""
    snap, model, opt = _unready_run(snap_env, 3, **_guarded(snap_env, monkeypatch))
    try:
        _step(model, opt)  # step 3 under way: the live state is no boundary's
        waiting, in_copy, looking = threading.Event(), threading.Event(), threading.Event()
        inner = parts.wait_next_boundary()
        real_snapshot = Copier.snapshot

        def slow_snapshot(self: Copier, step: int, *a: object) -> None:
            if step == 3:  # the timeline says 3 already; the copy is not handed over yet
                in_copy.set()
                looking.wait(60)
                time.sleep(0.3)  # the flush thread checks meanwhile
            real_snapshot(self, step, *a)

        def spy(s, step, timeout):
            waiting.set()
            in_copy.wait(60)
            looking.set()
            return inner(s, step, 120.0)
        monkeypatch.setattr(Copier, "snapshot", slow_snapshot)
        parts.replace_wait_next_boundary(monkeypatch, spy)
        done, paths = _spy_flush(snap, monkeypatch)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert waiting.wait(120), "the flush did not wait for the next boundary"
        want = _state(model, opt)
        snap.boundary(3)  # the arena the flush made takes it
        assert done.wait(120) and paths and paths[0] is not None
        assert _disk_steps(snap_env) == [3]
        assert snap.stats()["snapshots"] == 1
    finally:
        snap.close(flush=False)
    _restored(snap_env, want, 3)


# ------------------------------------------------------- a kill in a restart
def _child_leave(directory: str) -> None:
    model, opt = _adam()
    snap = _snap(directory, model, opt)
    assert snap.arena_ready(120)
    for step in range(5):
        _step(model, opt)
        snap.boundary(step)
    assert snap.wait(60)
    snap.close(keep_arena=True, flush=False)


def _child_kill(directory: str) -> None:
    arena_gate.gate = threading.Event()  # the inherited arena's pre-fault stays held
    model, opt = _adam(seed=3)
    snap = _snap(directory, model, opt)
    start = snap.restore_latest()
    for step in range(start, start + 3):
        _step(model, opt)
        snap.boundary(step)
    assert snap.wait(60)
    st = snap.stats()
    digest = {k: v.double().sum().item() for k, v in _state(model, opt).items()}
    print(json.dumps({"start": start, "last": start + 2, "held": parts.prep(snap).busy,
                      "skipped_not_ready": st["skipped_not_ready"], "digest": digest}),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_kill_in_a_restart_window_loses_at_most_one_step(snap_env):
    env = {"CUDASNAP_JOB": snap_env.job}
    p = run_script(__file__, "leave", snap_env.dir, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_script(__file__, "kill", snap_env.dir, env=env)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    r = last_json(p)
    assert r["start"] == 5 and r["held"], r  # the arena's pre-fault never ran: not ready
    model, opt = _adam(seed=9)
    snap = _snap(snap_env.dir, model, opt)
    try:
        got = snap.restore_latest() - 1
        assert got >= r["last"] - 1, f"the kill lost {r['last'] - got} steps"
        assert got == r["last"] and r["skipped_not_ready"] == 0, r
        digest = {k: v.double().sum().item() for k, v in _state(model, opt).items()}
        assert digest == r["digest"]
    finally:
        snap.close(flush=False)


# --------------------------------------------- the arena a dying script leaves
DIE_SCRIPT = """
import sys, torch, cudasnap
model = torch.nn.Linear(64, 64)
opt = torch.optim.Adam(model.parameters())
snap = cudasnap.Snapshotter(model, opt, directory=sys.argv[1])
for step in range(3):
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    snap.boundary(step)
snap.wait()
print("arena", snap.arena_path, flush=True)
if sys.argv[2] == "close":
    snap.close()
elif sys.argv[2] == "with":
    with snap:
        raise RuntimeError("boom")
raise RuntimeError("boom")
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "with", "close"])
def test_a_script_dying_names_the_arena_it_leaves(snap_env, how):
    import subprocess

    p = subprocess.run([sys.executable, "-c", DIE_SCRIPT, str(snap_env.dir), how],
                       env={**os.environ, "CUDASNAP_JOB": snap_env.job}, cwd=snap_env.tmp,
                       capture_output=True, text=True, timeout=300)
    path = str(snap_env.arena_path())
    lines = [ln for ln in p.stderr.splitlines() if "cudasnap gc" in ln]
    if how == "close":
        assert p.returncode == 1 and "RuntimeError" in p.stderr
        assert lines == [] and not os.path.exists(path), p.stderr[-2000:]
        return
    assert p.returncode == 1 and "RuntimeError: boom" in p.stderr, p.stderr[-3000:]
    assert os.path.exists(path), "the arena is kept on purpose (a restart adopts it)"
    assert len(lines) == 1, p.stderr[-3000:]
    assert path in lines[0] and " GB of shared memory" in lines[0] and "step 2" in lines[0]


def test_an_empty_arena_left_at_exit_is_removed(snap_env):
    from cudasnap._native import native

    path = snap_env.scratch_arena("empty")
    a = native().Arena.create(str(path), 2, 1 << 20, 1 << 16, CHUNK, "j", False)
    a.claim_owner()
    del a
    assert arena_exit.report_left_arena(str(path)) is None
    assert not path.exists()


if __name__ == "__main__":
    {"leave": _child_leave, "kill": _child_kill}[sys.argv[1]](sys.argv[2])
