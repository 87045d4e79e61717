"""The CUDA path of tests/core/test_start_window.py (issue 23 item 2) under the emulated runtime.

Before the arena is ready (the background set-up held by ``cudasnap._testing.arena_gate``),
a ``close()`` or a ``flush()`` makes the arena on the calling thread, page-locks it
and copies the live device state into it (the CUDA copy engine): a fresh attempt's
arena is created here, a restart's inherited one (its pre-fault and registration held
in the background) is registered here. State changes through host-to-device copies
(the emulator runs no kernels).
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import parts  # noqa: E402

MiB = 1 << 20


@pytest.fixture()
def gate(monkeypatch: pytest.MonkeyPatch) -> Any:
    from cudasnap._testing import arena_gate

    ev = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", ev)
    yield ev
    ev.set()


def _model(k: float) -> torch.nn.Module:
    m = torch.nn.Module()
    m.p = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(MiB // 2, device="cuda"))
                                 for _ in range(4))
    _set(m, k)
    return m


def _set(m: torch.nn.Module, k: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(m.p):
            p.copy_(torch.full(p.shape, k + i))  # host -> device


def _snap(env: Any, m: torch.nn.Module) -> Any:
    import cudasnap

    return cudasnap.Snapshotter(m, None, directory=env.dir, job=env.job, health=False,
                                arena_sync_max_bytes=0)


def _restored(env: Any) -> tuple[int, list[float]]:
    m = _model(-1.0)
    snap = _snap(env, m)
    try:
        step = snap.restore_latest() - 1
        return step, [float(p.detach().cpu()[0]) for p in m.p]
    finally:
        snap.close(flush=False)


def test_close_before_the_arena_is_ready_copies_the_device_state(snap_env: Any, emu: Any,
                                                                 gate: Any) -> None:
    from cudasnap.storage import posix

    m = _model(0.0)
    snap = _snap(snap_env, m)
    before = emu.counter("cudaMemcpyAsync")
    for step in range(3):
        _set(m, 10.0 * step)
        snap.boundary(step)
    st = snap.stats()
    assert st["skipped_not_ready"] == 3 and st["snapshots"] == 0, st
    snap.close()
    assert [s.step for s in posix.list_snapshots(snap_env.dir)] == [2]
    assert emu.counter("cudaMemcpyAsync") > before  # through the CUDA engine
    assert _restored(snap_env) == (2, [20.0, 21.0, 22.0, 23.0])


def test_flush_in_a_restart_window_registers_the_inherited_arena(snap_env: Any, emu: Any,
                                                                  monkeypatch: Any) -> None:
    from cudasnap._testing import arena_gate

    m = _model(0.0)
    snap = _snap(snap_env, m)
    assert snap.arena_ready(60)
    snap.boundary(0)
    assert snap.wait(60)
    snap.close(keep_arena=True, flush=False)
    del snap

    gate = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", gate)
    try:
        m2 = _model(-1.0)
        snap2 = _snap(snap_env, m2)
        try:
            assert parts.prep(snap2).pending  # pre-fault + cudaHostRegister of the inherited arena
            assert snap2.restore_latest() == 1
            _set(m2, 50.0)
            snap2.boundary(1)
            assert snap2.stats()["skipped_not_ready"] == 1  # CUDA: not usable unregistered
            path = snap2.flush()
            assert path is not None
            st = snap2.stats()
            assert st["early_saves"] == 1 and st["staging"]["page_locked"], st
            _set(m2, 60.0)
            snap2.boundary(2)  # the arena registered for the flush takes it
            assert snap2.wait(60) and snap2.stats()["snapshots"] == 2
        finally:
            snap2.close()
    finally:
        gate.set()
    assert _restored(snap_env) == (2, [60.0, 61.0, 62.0, 63.0])
