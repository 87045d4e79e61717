"""CPU-testable fixes of the CUDA path (issue 11): arena regrowth keeps the last
snapshot, every wait on a copy is bounded, one CUDA device per process, the
public fence() and the old layout kept alive, non-vacuous fences.

A stalled copier is made with the CPU engine's test knob
``set_test_chunk_delay_us`` (each chunk copy first sleeps), never by a
wall-clock bound in the assertion.
"""
from __future__ import annotations

import gc
import threading
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import parts
from torch import nn

import cudasnap
from cudasnap._native import native
from cudasnap.core.live_tensor import single_cuda_device
from cudasnap.errors import ConfigError, StagingError
from cudasnap.storage import posix

CHUNK = 64 << 10


@pytest.fixture()
def C():
    return native()


def _adam(dim=64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt):
    model(torch.randn(8, model[0].in_features)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snap(env, model, opt, **kw):
    return cudasnap.Snapshotter(model, opt, directory=env.dir, copy_threads=1,
                                chunk_bytes=CHUNK, **kw)


def _reachable_steps(env):
    """Steps a crash now would leave restorable: the arena file's valid slots + disk."""
    C = native()
    steps = {s.step for s in posix.list_snapshots(env.dir)}
    path = env.arena_path()
    if path.exists():
        a = C.Arena.open(str(path), False)
        steps |= {a.slot_info(i)["step"] for i in range(a.num_slots) if a.slot_info(i)["valid"]}
    return steps


# ------------------------------------------------------------- 1. regrowth
def test_regrowth_releases_old_arena_first_and_keeps_last_snapshot(snap_env):
    """boundary() before the first optimizer step (Adam state empty), then growth: the
    old arena is unmapped before the new one is created (so /dev/shm need not hold
    both), and until the new arena holds a COMPLETE snapshot a crash still finds the
    old one (it is flushed to disk first)."""
    model, opt = _adam(256)  # Adam's moments (2x the parameters) outgrow the headroom
    snap = _snap(snap_env, model, opt)
    mapped_at_create = []
    create = parts.keeper(snap).create_arena

    def spy(*a):
        maps = open("/proc/self/maps").read()
        mapped_at_create.append(sum(str(snap.arena_path) in ln for ln in maps.splitlines()))
        return create(*a)

    parts.keeper(snap).create_arena = spy
    try:
        snap.boundary(0)
        assert snap.wait(30)
        _step(model, opt)  # Adam state appears: the state grows
        parts.engine(snap).set_test_chunk_delay_us(30_000_000)  # the new copy stalls until released
        snap.boundary(1)
        assert not parts.job(snap).done(1)  # step 1 is not COMPLETE yet
        assert mapped_at_create == [0, 0], "the old arena was still mapped at re-creation"
        assert 0 in _reachable_steps(snap_env), "step 0 is lost while step 1 copies"
        assert snap.stats()["arena_regrowths"] == 1
        parts.engine(snap).set_test_chunk_delay_us(0)
        assert snap.wait(60)
        assert 1 in _reachable_steps(snap_env)
    finally:
        snap.close()


# ------------------------------------------------------- 2. bounded waits
def _plan(C, buf, chunk=4096):
    return C.build_plan([buf.ctypes.data], [buf.size], [1], [True], chunk, 4096, 4096)


def _engine_arena(C, env, buf, chunk=4096):
    plan = _plan(C, buf, chunk)
    path = env.scratch_arena("bw")
    arena = C.Arena.create(str(path), 2, plan.total_bytes + chunk, 1 << 16, chunk, "t", False)
    return plan, arena


def test_shutdown_of_a_stalled_copy_is_bounded_and_invalidates_the_slot(C, snap_env):
    buf = np.arange(64 << 10, dtype=np.uint8)
    plan, arena = _engine_arena(C, snap_env, buf)
    eng = C.CpuCopyEngine(1)
    eng.set_test_chunk_delay_us(10_000_000)  # 10 s per chunk: stalled
    job = eng.submit(arena, 0, plan, 7, b"{}")
    assert eng.shutdown(0.05) is False  # abandoned, not waited for
    assert job.failed and "abandoned" in job.error
    assert not arena.slot_info(0)["valid"]


def test_fence_on_a_stalled_copy_gives_up_and_the_slot_never_completes(C, snap_env):
    buf = np.arange(64 << 10, dtype=np.uint8)
    plan, arena = _engine_arena(C, snap_env, buf)
    eng = C.CpuCopyEngine(1)
    eng.wait_timeout_s = 0.05
    eng.set_test_chunk_delay_us(10_000_000)
    try:
        job = eng.submit(arena, 0, plan, 7, b"{}")
        assert eng.fence(job, 1) is False
        assert job.failed and "fence waited" in job.error
        # The abandoned copy drains at once; a submit waiting for a stalled one is bounded.
        job = eng.submit(arena, 1, plan, 8, b"{}")
        with pytest.raises(StagingError, match="still copying"):
            eng.submit(arena, 0, plan, 9, b"{}")
        eng.set_test_chunk_delay_us(0)
        assert job.wait(1, 60.0)
    finally:
        assert eng.shutdown(60.0)
    assert not arena.slot_info(0)["valid"] and arena.slot_info(1)["valid"]


def test_flush_is_not_blocked_by_a_submit_inside_the_engine(snap_env):
    """A flush (signal thread) while the trainer sits inside the engine's submit()."""
    model, opt = _adam()
    _step(model, opt)
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(0)
        assert snap.wait(30)
        entered, release = threading.Event(), threading.Event()
        real = parts.engine(snap)

        class Stuck:
            def __getattr__(self, name):
                return getattr(real, name)

            def submit(self, *a):
                entered.set()
                release.wait(60)
                return real.submit(*a)

        parts.swap_engine(snap, Stuck())
        t = threading.Thread(target=snap.boundary, args=(1,))
        t.start()
        assert entered.wait(30)
        path = snap.flush(wait=False)  # must not wait for the stuck submit
        assert not release.is_set() and t.is_alive()
        assert path is not None and [s.step for s in posix.list_snapshots(snap_env.dir)] == [0]
        release.set()
        t.join(60)
        parts.swap_engine(snap, real)
        assert snap.wait(30)
    finally:
        snap.close()


# -------------------------------------------------------- 3. one device
def _fake(name, dev):
    t = SimpleNamespace(is_cuda=dev is not None,
                        device=torch.device("cuda", dev) if dev is not None else None)
    return SimpleNamespace(name=name, tensor=t)


def test_state_on_two_cuda_devices_is_refused():
    assert single_cuda_device([_fake("a", 1), _fake("h", None), _fake("b", 1)]).index == 1
    with pytest.raises(ConfigError, match=r"cuda:0 \(w\), cuda:1 \(v\)"):
        single_cuda_device([_fake("v", 1), _fake("w", 0)])
    with pytest.raises(ConfigError, match="more than one CUDA device"):
        single_cuda_device([_fake("a", 1)], expect=0)  # state moved after the engine began


# ------------------------------------------- 4. fence() + old layout alive
def test_public_fence_orders_a_write_the_hooks_do_not_see(snap_env):
    model, opt = _adam()
    _step(model, opt)
    ema = [p.detach().clone() for p in model.parameters()]
    snap = cudasnap.Snapshotter({"m": model}, opt, directory=snap_env.dir, copy_threads=1,
                                chunk_bytes=CHUNK, extra=None)
    try:
        w = model[0].weight
        snap.boundary(0)  # builds the engine; the copy of step 0 runs unstalled
        assert snap.wait(30)
        eng = parts.engine(snap)
        want = w.detach().clone()
        eng.set_test_chunk_delay_us(30_000_000)  # stalled until released below
        snap.boundary(1)
        assert not parts.job(snap).done(1)
        threading.Timer(0.2, eng.set_test_chunk_delay_us, (0,)).start()
        snap.fence()  # before an EMA-style in-place write outside optimizer.step()
        assert parts.job(snap) is None or parts.job(snap).done(1)
        with torch.no_grad():
            w.lerp_(ema[0] + 1, 0.5)
        assert snap.wait(30)
        snap2_model, snap2_opt = _adam()
        snap.close(keep_arena=True)
        snap = cudasnap.Snapshotter({"m": snap2_model}, snap2_opt, directory=snap_env.dir)
        assert snap.restore_latest() == 2
        assert torch.equal(snap2_model[0].weight, want)
    finally:
        snap.close()


def test_invalidate_layout_keeps_old_tensors_alive_until_the_copy_completes(snap_env):
    model, opt = _adam()
    _step(model, opt)
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(0)
        assert snap.wait(30)
        parts.engine(snap).set_test_chunk_delay_us(30_000_000)
        snap.boundary(1)
        p = model[0].weight
        old = opt.state[p]["exp_avg"]
        ref = weakref.ref(old)
        opt.state[p]["exp_avg"] = old.clone()  # replaced outside optimizer.step()
        snap.invalidate_layout()
        del old
        gc.collect()
        assert not parts.job(snap).done(1)
        assert ref() is not None, "the running copy's tensor was freed under it"
        parts.engine(snap).set_test_chunk_delay_us(0)
        assert snap.wait(30)
        gc.collect()
        assert ref() is None  # released once the copy completed
    finally:
        snap.close()


# ---------------------------------------------------- 7. non-vacuous fences
def test_step_hook_fence_waits_for_a_stalled_copy(snap_env):
    """The copy is stalled, so without the phase-1 fence the optimizer step would
    change the parameters before they are copied: the snapshot must still hold the
    state at the boundary, and the fence must have waited."""
    model, opt = _adam()
    _step(model, opt)
    snap = _snap(snap_env, model, opt)
    try:
        snap.boundary(0)
        assert snap.wait(30)
        eng = parts.engine(snap)
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        eng.set_test_chunk_delay_us(30_000_000)
        snap.boundary(1)
        assert not parts.job(snap).done(1)
        threading.Timer(0.2, eng.set_test_chunk_delay_us, (0,)).start()
        _step(model, opt)  # the step pre-hook (and BatchNorm's forward hook) must wait
        assert parts.job(snap) is None or parts.job(snap).done(1)
        assert snap.wait(30)
        m2, o2 = _adam()
        snap.close(keep_arena=True)
        snap = _snap(snap_env, m2, o2)
        assert snap.restore_latest() == 2
        for k, v in m2.state_dict().items():
            assert torch.equal(v, want[k]), k
    finally:
        snap.close()


def test_stats_report_the_staging_footprint(snap_env):
    model, opt = _adam()
    _step(model, opt)
    snap = _snap(snap_env, model, opt)
    try:
        assert snap.stats()["staging"] is None  # no arena before the first boundary
        snap.boundary(0)
        st = snap.stats()["staging"]
        assert st["path"] == str(snap.arena_path) and st["shared"]
        assert st["bytes"] == snap_env.arena_path().stat().st_size
        assert st["page_locked"] is False and st["fallback_reason"] is None  # CPU backend
    finally:
        snap.close()
