"""Issue 11 item 8 on the CPU: where cudaHostRegister of the shared-memory arena is refused
(VMs, gVisor, a memlock limit), ``pin_arena`` says why, falls back to a process-private
pinned arena of the same geometry, drops the empty shared file, and the reason reaches
``stats()["staging"]["fallback_reason"]`` through the background preparer. The CUDA calls
themselves are replaced (no GPU here); the GPU run checks the real refusal path
(tests/cuda/test_gpu_e2e.py)."""
from __future__ import annotations

import logging

import cudasnap._cuda as cuda_mod
from cudasnap._native import native
from cudasnap.core import arena_preparer

CHUNK = 1 << 20
REASON = "cudaHostRegister failed: operation not supported (cudaErrorNotSupported)"


class _RefusingNative:
    """The real engine, but registration is refused and the private arena is a plain one."""

    def __init__(self, private_path: str) -> None:
        self._C, self._private_path, self.registered = native(), private_path, []

    def register_arena(self, arena, device):
        self.registered.append((arena.path, device))
        return False, REASON

    def create_private_pinned_arena(self, num_slots, capacity, meta_capacity, chunk, job, device=-1):
        return self._C.Arena.create(self._private_path, num_slots, capacity, meta_capacity,
                                    chunk, job, False)

    def __getattr__(self, name):
        return getattr(self._C, name)


def test_a_refused_registration_falls_back_with_its_reason(snap_env, monkeypatch, caplog):
    C = native()
    shared = snap_env.scratch_arena("shared")
    arena = C.Arena.create(str(shared), 2, 4 * CHUNK, 1 << 16, CHUNK, "j", False)
    stub = _RefusingNative(str(snap_env.scratch_arena("private")))
    monkeypatch.setattr(cuda_mod, "native", lambda: stub)
    caplog.set_level(logging.WARNING)
    got, why = cuda_mod.pin_arena(arena, 3)
    assert stub.registered == [(str(shared), 3)]
    assert why == REASON
    assert got is not arena and (got.num_slots, got.data_capacity, got.chunk_bytes) == \
        (arena.num_slots, arena.data_capacity, arena.chunk_bytes)
    assert not shared.exists()  # an empty shared file would only hold memory
    assert any(REASON in r.getMessage() and "NOT survive" in r.getMessage()
               for r in caplog.records)
    got.unlink()


def test_a_shared_arena_holding_a_snapshot_is_kept(snap_env, monkeypatch):
    C = native()
    shared = snap_env.scratch_arena("held")
    arena = C.Arena.create(str(shared), 2, 4 * CHUNK, 1 << 16, CHUNK, "j", False)
    slot = arena.pick_write_slot()
    arena.begin_write(slot, 7, b"{}")
    arena.commit(slot, 7, 0)
    assert arena.newest_complete() == slot
    stub = _RefusingNative(str(snap_env.scratch_arena("private2")))
    monkeypatch.setattr(cuda_mod, "native", lambda: stub)
    got, why = cuda_mod.pin_arena(arena, 0)
    assert why == REASON and shared.exists()  # the predecessor's snapshot stays flushable
    got.unlink()
    arena.unlink()


def test_the_preparer_keeps_the_reason_for_stats():
    prep = arena_preparer.ArenaPreparer(0, None)
    prep.start("test arena", lambda cancel: (None, REASON, True))
    assert prep.wait(60)
    assert prep.fallback_reason == REASON
    got = prep.take()
    assert got is not None and got.fallback_reason == REASON
