"""A large state's copy plan is built off the training thread (issue 26: no boundary over
5 ms at 4,000 tensors, the first included).

The first boundary of a state of ``Layouts.OFF_THREAD_MIN_TENSORS`` tensors or more starts
the build on a background thread and is skipped (``stats()["skipped_layout"]``); its
live state is kept, so ``wait()``, ``flush()`` or ``close()`` before the next optimizer
step still save that step. A later boundary adopts the finished plan after a full check
that the state did not change under the build (else it builds again, here).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from helpers import parts
from torch import nn

import cudasnap
from cudasnap.core.plan_cache import Layouts


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(3 + i % 5)) for i in range(n)])
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def _trained(n: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Many(n)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _step(m, opt)
    return m, opt


def _step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    m.count += 1


def _state(m: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in m.state_dict().values()] + [
        v.clone() for s in opt.state_dict()["state"].values() for v in s.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@contextlib.contextmanager
def _first_boundary(snap_env) -> Iterator[tuple[nn.Module, torch.optim.Optimizer,
                                                 cudasnap.Snapshotter]]:
    """A 1,801-tensor state whose first boundary (step 0) was just deferred; closed after."""
    m, opt = _trained(600)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        snap.arena_ready()
        snap.boundary(0)
        yield m, opt, snap
    finally:
        snap.close()


def _restores_step_0_in_a_new_process(snap_env, want: list[torch.Tensor]) -> None:
    m2, opt2 = _trained(600, seed=1)  # other values, no optimizer state yet
    fresh = cudasnap.Snapshotter(m2, opt2, directory=snap_env.dir, backend="cpu")
    try:
        assert fresh.restore_latest() == 1
        assert _same(_state(m2, opt2), want)
    finally:
        fresh.close()


def _join_build(snap: cudasnap.Snapshotter) -> None:
    b = parts.layouts(snap).building
    if b is not None:
        b.thread.join(60)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of every plan build."""
    seen: list[int] = []
    real = parts.layout_build()

    def spy(self: Layouts) -> object:
        seen.append(threading.get_ident())
        return real(self)

    parts.replace_layout_build(spy, monkeypatch)
    return seen


def test_the_first_boundary_of_a_large_state_builds_its_plan_off_the_training_thread(
        snap_env, builds):
    m, opt = _trained(600)  # 1,801 state tensors
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        snap.arena_ready()
        snap.boundary(0)
        st = snap.stats()
        assert st["skipped_layout"] == 1 and st["snapshots"] == 0, st
        _join_build(snap)
        assert builds and builds[0] != threading.get_ident()
        _step(m, opt)
        snap.boundary(1)  # adopts the finished plan: no build here
        assert snap.wait(30)
        want = _state(m, opt)
        st = snap.stats()
        assert st["snapshots"] == 1 and st["layout_rebuilds"] == 1, st
        assert len(builds) == 1
        _step(m, opt)
        assert snap.rollback() == 2
        assert _same(_state(m, opt), want)
    finally:
        snap.close()


def test_a_small_state_is_still_snapshotted_from_its_first_boundary(snap_env, builds):
    m, opt = _trained(20)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        snap.boundary(0)
        assert snap.wait(30)
        st = snap.stats()
        assert st["skipped_layout"] == 0 and st["snapshots"] == 1, st
        assert builds == [threading.get_ident()]
    finally:
        snap.close()


def test_wait_after_a_deferred_boundary_copies_that_step(snap_env):
    with _first_boundary(snap_env) as (m, opt, snap):
        want = _state(m, opt)
        assert snap.stats()["skipped_layout"] == 1
        assert snap.wait(30)  # waits for the build, then copies the live state of step 0
        st = snap.stats()
        assert st["snapshots"] == 1 and st["live_saves"] == 1, st
        _step(m, opt)
        assert snap.rollback() == 1
        assert _same(_state(m, opt), want)


def test_wait_after_the_state_moved_on_copies_nothing_stale(snap_env):
    with _first_boundary(snap_env) as (m, opt, snap):
        _step(m, opt)  # the optimizer step's fence marks the live state moved on
        assert snap.wait(30)
        assert snap.stats()["snapshots"] == 0  # step 0's state is gone: not copied as it


def test_flush_after_a_deferred_boundary_writes_that_step(snap_env):
    with _first_boundary(snap_env) as (m, opt, snap):
        want = _state(m, opt)
        path = snap.flush()
        assert path is not None and path.name == "step-00000000"
    _restores_step_0_in_a_new_process(snap_env, want)


def test_a_state_changed_under_the_build_is_planned_again(snap_env, monkeypatch):
    """The build walked the state, then a tensor was replaced in its container before
    the plan was adopted: the adoption's full check finds it and the plan is rebuilt,
    so the snapshot holds the new tensor, not the one the build saw."""
    m, opt = _trained(600)
    gate, walked = threading.Event(), threading.Event()
    real = parts.layout_build(now=True)

    def slow(self: Layouts) -> object:
        lay = real(self)
        if threading.current_thread().name == "cudasnap-layout":
            walked.set()
            gate.wait(60)
        return lay

    parts.replace_layout_build(slow, monkeypatch, now=True)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        snap.arena_ready()
        snap.boundary(0)
        assert walked.wait(60)
        p = m.ps[7]
        opt.state[p]["exp_avg"] = torch.full_like(p, 42.0)  # replaced, not written in place
        gate.set()
        _join_build(snap)
        snap.boundary(1)
        assert snap.wait(30)
        st = snap.stats()
        assert st["snapshots"] == 1 and st["layout_rebuilds"] == 2, st
        want = _state(m, opt)
        opt.state[p]["exp_avg"].zero_()
        assert snap.rollback() == 2
        assert torch.equal(opt.state[p]["exp_avg"], torch.full_like(p, 42.0))
        assert _same(_state(m, opt), want)
    finally:
        gate.set()
        snap.close()


def test_a_failed_background_build_is_redone_on_the_training_thread(snap_env, monkeypatch):
    m, opt = _trained(600)
    real = parts.layout_build(now=True)

    def failing(self: Layouts) -> object:
        if threading.current_thread().name == "cudasnap-layout":
            raise RuntimeError("dictionary changed size during iteration")
        return real(self)

    parts.replace_layout_build(failing, monkeypatch, now=True)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        snap.arena_ready()
        snap.boundary(0)
        _join_build(snap)
        _step(m, opt)
        snap.boundary(1)  # builds here, snapshots step 1
        assert snap.wait(30)
        want = _state(m, opt)
        assert snap.stats()["snapshots"] == 1
        _step(m, opt)
        assert snap.rollback() == 2
        assert _same(_state(m, opt), want)
    finally:
        snap.close()


def test_close_after_a_deferred_boundary_saves_that_step(snap_env):
    m, opt = _trained(600)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    snap.arena_ready()
    snap.boundary(0)
    want = _state(m, opt)
    snap.close()
    _restores_step_0_in_a_new_process(snap_env, want)


def test_close_after_a_deferred_rebuild_saves_that_step(snap_env):
    """The arena in use: a rebuild of the plan (invalidate_layout()) defers a later
    boundary; close()'s final flush would write the older COMPLETE step, so the deferred
    boundary's live state is copied first (EarlySaver.at_close -> Copier.settle_deferred).
    (Without a flush since step 1, the final flush's own live copy would save it too.)"""
    m, opt = _trained(600)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    snap.arena_ready()
    snap.boundary(0)
    _join_build(snap)
    _step(m, opt)
    snap.boundary(1)
    assert snap.wait(30) and parts.arena(snap) is not None
    assert snap.flush() is not None  # step 1 on disk: close()'s final flush has nothing new
    snap.invalidate_layout()
    _step(m, opt)
    snap.boundary(2)
    st = snap.stats()
    assert st["skipped_layout"] == 2 and st["snapshots"] == 1, st
    want = _state(m, opt)
    snap.close()
    m2, opt2 = _trained(600, seed=1)
    fresh = cudasnap.Snapshotter(m2, opt2, directory=snap_env.dir, backend="cpu")
    try:
        assert fresh.restore_latest() == 3
        assert _same(_state(m2, opt2), want)
    finally:
        fresh.close()


def _layout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cudasnap-layout"]


@pytest.mark.parametrize("stepped", [True, False], ids=["stepped", "before-the-first-step"])
def test_the_first_build_thread_is_started_at_construction_not_at_the_boundary(
        snap_env, monkeypatch, stepped):
    """Thread.start() at the boundary waits for the new thread to be scheduled (up to
    16 ms measured beside an arena set-up on 2 cores): the first build's thread is started
    parked by the constructor, also before the optimizer made its state (counted as
    two tensors per parameter), and the boundary only lets it go."""
    if stepped:
        m, opt = _trained(600)
    else:
        torch.manual_seed(0)
        m = Many(600)  # 601 model tensors; AdamW adds 2 (+ a step) per parameter later
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = set(_layout_threads())
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        parked = [t for t in _layout_threads() if t not in before]
        assert len(parked) == 1 and parked[0].is_alive()
        if not stepped:
            _step(m, opt)
        started: list[str] = []
        real_start = threading.Thread.start

        def spy(self):
            started.append(self.name)
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", spy)
        snap.boundary(0)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert snap.stats()["skipped_layout"] == 1
        assert "cudasnap-layout" not in started, "the boundary started a build thread"
        assert snap.wait(60) and snap.last_step == 0  # the live state of step 0, copied
        _step(m, opt)
        snap.boundary(1)  # adopts the parked thread's plan
        assert snap.wait(60)
        parked[0].join(60)
        assert not parked[0].is_alive()
    finally:
        snap.close(flush=False)


def test_a_parked_build_thread_ends_with_close_and_small_states_park_none(snap_env):
    before = set(_layout_threads())
    m, opt = _trained(600)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    parked = [t for t in _layout_threads() if t not in before]
    assert len(parked) == 1
    snap.close(flush=False)  # never asked for: it ends without building
    parked[0].join(60)
    assert not parked[0].is_alive()
    small_m, small_opt = _trained(10)
    snap = cudasnap.Snapshotter(small_m, small_opt, directory=snap_env.dir / "small",
                                backend="cpu")
    try:
        assert [t for t in _layout_threads() if t not in before and t.is_alive()] == []
    finally:
        snap.close(flush=False)


def test_a_deferring_boundary_that_raises_still_lets_its_build_go(snap_env, monkeypatch):
    """The boundary's host state failing after the build was asked for: the build still
    runs (it is let go in a ``finally``), and the next boundary adopts it."""
    from cudasnap.core.copier import Copier

    m, opt = _trained(600)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    try:
        real = Copier.host_suffix
        calls = []

        def fail_once(self, step):
            calls.append(step)
            if len(calls) == 1:
                raise RuntimeError("injected: host state unreadable")
            return real(self, step)

        monkeypatch.setattr(Copier, "host_suffix", fail_once)
        with pytest.raises(RuntimeError, match="injected"):
            snap.boundary(0)
        b = parts.layouts(snap).building
        assert b is not None and b.go.is_set(), "the build was left parked"
        b.thread.join(60)
        assert b.layout is not None  # it built
        _step(m, opt)
        snap.boundary(1)
        assert snap.wait(60) and snap.last_step == 1 and snap.stats()["snapshots"] >= 1
    finally:
        snap.close(flush=False)


def test_close_joins_a_build_dropped_while_it_ran(snap_env, monkeypatch):
    """invalidate_layout() during a background build drops it; close() still waits for its
    thread (it may be making the copy engine)."""
    gate = threading.Event()
    real = parts.layout_build()

    def slow(self):
        if threading.current_thread().name == "cudasnap-layout":
            gate.wait(60)
        return real(self)

    parts.replace_layout_build(slow, monkeypatch)
    m, opt = _trained(600)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, backend="cpu")
    b = None
    try:
        snap.boundary(0)
        b = parts.layouts(snap).building
        assert b is not None
        snap.invalidate_layout()  # dropped while it runs (held at the gate)
        assert parts.layouts(snap).building is None and b in parts.layouts(snap).dropped
        threading.Timer(0.2, gate.set).start()
    finally:
        snap.close(flush=False)
    assert b is not None and not b.thread.is_alive(), "close() returned before the build ended"
