"""The CUDA path of tests/core/test_layout_off_thread.py under the emulated runtime (issue 26).

A state of 1,000+ tensors on the GPU: the first boundary hands the copy plan's build to a
background thread, which also makes the CUDA copy engine and attaches the allocator
tracker (the CUDA plan is made from the registry); the training thread adopts the plan at
a later boundary and the copy engine copies the device state. State changes through
host-to-device copies (the emulator runs no kernels).
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from helpers import parts

N = 1200  # parameters, each its own small device tensor


def _model(k: float) -> torch.nn.Module:
    m = torch.nn.Module()
    m.p = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(16, device="cuda"))
                                 for _ in range(N))
    _set(m, k)
    return m


def _set(m: torch.nn.Module, k: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(m.p):
            p.copy_(torch.full(p.shape, k + i))  # host -> device


def _values(m: torch.nn.Module) -> list[float]:
    return [float(p.detach().cpu()[0]) for p in m.p]


def _snap(env: Any, m: torch.nn.Module) -> Any:
    import cudasnap

    return cudasnap.Snapshotter(m, None, directory=env.dir, job=env.job, health=False)


def test_the_plan_and_the_cuda_engine_are_made_off_the_training_thread(snap_env: Any,
                                                                       emu: Any) -> None:
    from cudasnap.core.plan_cache import Layouts

    made: list[str] = []
    real = parts.layout_build()

    def spy(self: Layouts) -> Any:
        made.append(threading.current_thread().name)
        return real(self)

    m = _model(0.0)
    snap = _snap(snap_env, m)
    parts.replace_layout_build(spy)
    try:
        snap.arena_ready()
        snap.boundary(0)
        assert snap.stats()["skipped_layout"] == 1
        b = parts.layouts(snap).building
        assert b is not None
        b.thread.join(120)
        assert made == ["cudasnap-layout"]
        assert snap.stats()["backend"] == "cuda" and parts.cuda(snap) is not None
        _set(m, 100.0)
        snap.boundary(1)  # adopts the plan: the CUDA engine copies
        assert snap.wait(60)
        st = snap.stats()
        assert st["snapshots"] == 1 and st["layout_rebuilds"] == 1, st
        _set(m, 200.0)
        assert snap.flush() is not None
    finally:
        parts.replace_layout_build(real)
        snap.close(flush=False)
    m2 = _model(-1.0)
    fresh = _snap(snap_env, m2)
    try:
        assert fresh.restore_latest() == 2
        torch.cuda.synchronize()
        assert _values(m2) == [100.0 + i for i in range(N)]
    finally:
        fresh.close(flush=False)


def test_close_right_after_a_deferred_boundary_saves_the_device_state(snap_env: Any,
                                                                      emu: Any) -> None:
    m = _model(7.0)
    snap = _snap(snap_env, m)
    snap.arena_ready()
    snap.boundary(0)
    assert snap.stats()["skipped_layout"] == 1
    snap.close()  # waits for the build, copies step 0 from the device, flushes it
    m2 = _model(-1.0)
    fresh = _snap(snap_env, m2)
    try:
        assert fresh.restore_latest() == 1
        torch.cuda.synchronize()
        assert _values(m2) == [7.0 + i for i in range(N)]
    finally:
        fresh.close(flush=False)
