"""The CUDA bindings of cudasnap._C under the emulated CUDA runtime (issue 21 items 1, 6, 7, 9).

* item 1: every CUDA binding runs (most release the GIL: a Python object made or
  dropped there crashed the first registration);
* item 6: a CUDA graph capture on the trainer's thread stays valid while a
  snapshot copy is in flight (the completion thread polls events) and while the
  arena is registered / pinned memory allocated on another thread;
* item 7: a boundary while the compute stream captures, or while a blocking
  stream captures (the legacy stream reports cudaErrorStreamCaptureImplicit),
  is skipped and counted, never raised;
* item 9: an arena dropped while registered is unregistered before it is
  unmapped, so a new arena mapped at the same address registers.
"""
from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import parts

from cudasnap import _C
from cudasnap.errors import SnapshotError

CHUNK = 1 << 16
COPY_DELAY_US = 1_000_000  # the snapshot copy stays in flight this long


def make_arena(path: Path, data: int = 1 << 20, prefault: bool = True) -> Any:
    return _C.Arena.create(str(path), 2, data, 1 << 16, CHUNK, "native-cuda", prefault)


def device_bytes(n: int, key: int) -> torch.Tensor:
    """A CUDA uint8 tensor with a known pattern (set by a host-to-device copy)."""
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    t.copy_((torch.arange(n, dtype=torch.int64) * 7 + key) % 251)
    return t


def make_snap(env: Any, **kw: Any) -> tuple[Any, torch.nn.Module]:
    import cudasnap

    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = cudasnap.Snapshotter(model, opt, directory=env.dir, job=env.job, health=False, **kw)
    snap.boundary(0)
    assert snap.wait(timeout=60), "the first snapshot did not complete"
    assert parts.cuda(snap) is not None and parts.arena(snap) is not None
    return snap, model


def capture_copy(body: Any = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """Captures ``static.copy_(src)`` on a side stream in torch's default (global)
    capture mode, running ``body()`` inside the capture; returns (graph, static, src).
    Raises when the capture was invalidated."""
    static = torch.empty(256, device="cuda")
    src = torch.empty(256, device="cuda")
    src.copy_(torch.arange(256, dtype=torch.float32))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    # capture_begin/capture_end directly: torch.cuda.graph's __enter__ synchronizes
    # the device, which would wait for the snapshot copy this test keeps in flight.
    with torch.cuda.stream(side):
        g.capture_begin()
        try:
            static.copy_(src)
            if body is not None:
                body()
        finally:
            g.capture_end()
    return g, static, src


def replay_checks(g: torch.cuda.CUDAGraph, static: torch.Tensor, src: torch.Tensor) -> None:
    static.copy_(torch.zeros(256))
    src.copy_(torch.arange(256, dtype=torch.float32) * 3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.cpu(), torch.arange(256, dtype=torch.float32) * 3)


# ------------------------------------------------------------------- item 1
def test_every_cuda_binding_runs(emu: Any, snap_env: Any) -> None:
    assert _C.cuda_device_count() == 1
    torch.cuda.init()
    eng = _C.CudaCopyEngine(0, 2)
    try:
        assert (eng.device, eng.crc_threads, eng.gather_small, eng.gather_max_bytes) == (
            0, 2, False, 64 * 1024)
        assert eng.busy is False and eng.hung is False and eng.copy_stream != 0
        eng.set_test_copy_delay_us(2000)

        path = snap_env.scratch_arena("bind")
        arena = make_arena(path)
        pinned_before = emu.counter("pinned_ranges")
        assert _C.register_arena(arena, 0) == (True, "")
        assert arena.cuda_registered and emu.is_pinned(arena.data_ptr(0), 1)
        assert _C.register_arena(arena) == (True, "already registered")

        # a copy through the engine: submit, fence, wait (each releases the GIL)
        x = device_bytes(3 * CHUNK + 123, 5)
        plan = _C.build_plan([x.data_ptr()], [x.numel()], [1], [False], CHUNK)
        job = eng.submit(arena, 0, plan, 7, b'{"m":1}', 0, None)
        assert eng.fence(job, 1, 0) is True
        assert job.wait(1, 60) and not job.failed, job.error
        # one piece per chunk: a progress mark at each chunk boundary (checksums overlap)
        assert eng.last_memcpy_calls == 4 and eng.last_gathered == 0 and eng.last_staged == 0
        info = arena.slot_info(0)
        assert info["valid"] and info["step"] == 7
        assert bytes(arena.data_view(0, x.numel())) == bytes(x.cpu().numpy().tobytes())

        # snapshot-then-offload: a device buffer smaller than the state stages its first
        # bytes (device to device), the rest is copied directly; the slot is the same
        assert eng.device_staging_bytes == 0
        buf = torch.empty(2 * CHUNK, dtype=torch.uint8, device="cuda")
        eng.set_device_staging(buf.data_ptr(), buf.numel())
        assert eng.device_staging_bytes == 2 * CHUNK
        job = eng.submit(arena, 1, plan, 8, b'{"m":1}', 0, None)
        assert eng.fence(job, 1, 0) is True
        assert job.wait(1, 60) and not job.failed, job.error
        assert eng.last_staged == 2 * CHUNK
        assert arena.slot_info(1)["valid"] and arena.slot_info(1)["step"] == 8
        assert bytes(arena.data_view(1, x.numel())) == bytes(x.cpu().numpy().tobytes())
        assert arena.read_table(1) == arena.read_table(0)  # the same bytes, the same CRCs
        with pytest.raises(SnapshotError, match="not device memory"):
            eng.set_device_staging(arena.data_ptr(0), 4096)
        with pytest.raises(SnapshotError, match="or neither"):
            eng.set_device_staging(buf.data_ptr(), 0)
        eng.set_device_staging(0, 0)
        assert eng.device_staging_bytes == 0
        del buf
        deadline = time.monotonic() + 30  # busy turns false just after the job completes
        while eng.busy and time.monotonic() < deadline:
            time.sleep(0.001)
        assert eng.busy is False

        _C.unregister_arena(arena)
        assert not arena.cuda_registered and not emu.is_pinned(arena.data_ptr(0), 1)
        assert emu.counter("pinned_ranges") == pinned_before
        _C.unregister_arena(arena)  # not registered (any more): a no-op

        # item 1's reproduction: a read-only arena is refused with a reason, no crash
        ro = _C.Arena.open(str(path), False)
        ok, reason = _C.register_arena(ro, 0)
        assert ok is False and "read-only" in reason

        priv = _C.create_private_pinned_arena(2, 1 << 20, 1 << 16, CHUNK, "native-cuda")
        assert priv.cuda_registered and not priv.shared and emu.is_pinned(priv.data_ptr(0), 1)
        _C.unregister_arena(priv)  # not registered by register_arena: a no-op
        assert priv.cuda_registered and emu.is_pinned(priv.data_ptr(0), 1)
        addr = priv.data_ptr(0)
        del priv  # cudaFreeHost
        assert not emu.is_pinned(addr, 1)

        reg = _C.attach_allocator_tracker(16384)
        assert _C.attached_allocator_registry() is reg
        assert reg.healthy
    finally:
        assert eng.shutdown(60)


# ------------------------------------------------------------------- item 6
def test_capture_while_a_snapshot_copy_is_in_flight(emu: Any, snap_env: Any) -> None:
    snap, _ = make_snap(snap_env)
    try:
        snapshots = snap.stats()["snapshots"]
        # The copy stream runs nothing until released: the copy is in flight, and the
        # completion thread polls its events all through the capture, whatever the load.
        emu.hold(parts.cuda(snap).engine.copy_stream)
        try:
            snap.boundary(1)
            assert parts.cuda(snap).engine.busy, "the snapshot copy should be in flight"
            g, static, src = capture_copy(lambda: time.sleep(0.1))
            assert parts.cuda(snap).engine.busy, "the copy should have been in flight during the capture"
        finally:
            emu.release()
        replay_checks(g, static, src)
        assert snap.wait(timeout=60), "the snapshot copy did not complete"
        assert snap.stats()["snapshots"] == snapshots + 1
        assert parts.arena(snap).slot_info(parts.arena(snap).newest_complete())["step"] == 1
    finally:
        snap.close()


def test_capture_while_another_thread_registers_and_pins(emu: Any, snap_env: Any) -> None:
    arena = make_arena(snap_env.scratch_arena("prep"))
    dropped = make_arena(snap_env.scratch_arena("drop"))
    results: dict[str, Any] = {}

    def preparer() -> None:  # what the background arena preparer does, on its own thread
        nonlocal dropped
        try:
            results["register"] = _C.register_arena(arena, 0)
            priv = _C.create_private_pinned_arena(2, 1 << 20, 1 << 16, CHUNK, "native-cuda")
            results["private"] = priv.cuda_registered
            del priv  # cudaFreeHost
            results["register_dropped"] = _C.register_arena(dropped, 0)
            dropped = None  # ~Arena: cudaHostUnregister
            _C.unregister_arena(arena)
            results["done"] = True
        except Exception as e:  # reported below
            results["error"] = repr(e)

    def body() -> None:
        t = threading.Thread(target=preparer)
        t.start()
        t.join(60)

    g, static, src = capture_copy(body)
    assert results.get("done"), results
    assert results["register"] == (True, "") and results["register_dropped"] == (True, "")
    assert results["private"] is True
    replay_checks(g, static, src)


# ------------------------------------------------------------------- item 7
class BlockingCapture:
    """A blocking (flags 0) stream capturing in ``mode`` (0 global, 1 thread-local),
    made through the runtime's C API: torch's streams are all non-blocking."""

    def __init__(self, lib: Any, mode: int) -> None:
        self.lib, self.mode = lib, mode
        self.stream = ctypes.c_void_p()
        self.graph = ctypes.c_void_p()
        self.end_rc: int | None = None

    def __enter__(self) -> BlockingCapture:
        assert self.lib.cudaStreamCreate(ctypes.byref(self.stream)) == 0
        assert self.lib.cudaStreamBeginCapture(self.stream, ctypes.c_int(self.mode)) == 0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end_rc = int(self.lib.cudaStreamEndCapture(self.stream, ctypes.byref(self.graph)))
        self.lib.cudaStreamDestroy(self.stream)


@pytest.mark.parametrize("mode", [0, 1], ids=["global", "thread_local"])
def test_backend_capturing_counts_the_implicit_case(emu: Any, snap_env: Any, mode: int) -> None:
    """CudaBackend.capturing(): what a boundary can ask before it reads host state
    (torch.cuda.get_rng_state_all() raises in the implicit case)."""
    from cudasnap._cuda import CudaBackend

    torch.cuda.init()
    backend = CudaBackend(0, 1, track=False)
    try:
        assert backend.capturing() is False
        with BlockingCapture(emu.lib, mode) as cap:
            assert backend.capturing() is True  # legacy stream: cudaErrorStreamCaptureImplicit
            assert backend.capturing() is True  # the error was cleared, the answer stays
        assert cap.end_rc == 0, "asking invalidated the capture"
        assert backend.capturing() is False
        seen: list[bool] = []
        capture_copy(lambda: seen.append(backend.capturing()))  # the current stream captures
        assert seen == [True]
        assert backend.capturing() is False
    finally:
        backend.close(30)


@pytest.mark.parametrize("mode", [0, 1], ids=["global", "thread_local"])
def test_engine_while_a_blocking_stream_captures(emu: Any, snap_env: Any, mode: int) -> None:
    """submit on the legacy stream (cudaErrorStreamCaptureImplicit) is refused with a
    StagingError, never a CudaError; a fence there waits on the host."""
    from cudasnap.errors import StagingError

    torch.cuda.init()
    eng = _C.CudaCopyEngine(0, 1)
    arena = make_arena(snap_env.scratch_arena("implicit"))
    try:
        assert _C.register_arena(arena, 0)[0]
        x = device_bytes(2 * CHUNK, 9)
        plan = _C.build_plan([x.data_ptr()], [x.numel()], [1], [False], CHUNK)
        eng.set_test_copy_delay_us(50_000)
        job = eng.submit(arena, 0, plan, 1, b"{}", 0, None)
        with BlockingCapture(emu.lib, mode) as cap:
            assert eng.fence(job, 1, 0) is True  # a host wait: nothing joins the capture
            assert job.done(1) and not job.failed
            with pytest.raises(StagingError, match="another \\(blocking\\) stream"):
                eng.submit(arena, 1, plan, 2, b"{}", 0, None)
        assert cap.end_rc == 0, f"the capture was invalidated (cudaStreamEndCapture: {cap.end_rc})"
        assert arena.slot_info(1)["state"] == "EMPTY"  # never begun
        eng.set_test_copy_delay_us(0)
        job = eng.submit(arena, 1, plan, 2, b"{}", 0, None)  # capture over: copies again
        assert job.wait(1, 60) and not job.failed
    finally:
        assert eng.shutdown(60)


@pytest.mark.parametrize("mode", [0, 1], ids=["global", "thread_local"])
def test_boundary_while_a_blocking_stream_captures_is_skipped(
        emu: Any, snap_env: Any, mode: int, caplog: Any) -> None:
    lib = emu.lib
    # With the default RNG sources: torch.cuda.get_rng_state_all() itself raises
    # cudaErrorStreamCaptureImplicit while a blocking stream captures; boundary() skips
    # that step too (submit.py _snapshot), never raises.
    snap, _ = make_snap(snap_env)
    stream = ctypes.c_void_p()
    graph = ctypes.c_void_p()
    try:
        assert lib.cudaStreamCreate(ctypes.byref(stream)) == 0  # blocking (flags 0)
        st = snap.stats()
        assert lib.cudaStreamBeginCapture(stream, ctypes.c_int(mode)) == 0
        try:
            # the compute stream is the legacy stream: it reports
            # cudaErrorStreamCaptureImplicit while `stream` captures
            snap.boundary(1)
        finally:
            rc = lib.cudaStreamEndCapture(stream, ctypes.byref(graph))
        assert rc == 0, f"the capture was invalidated (cudaStreamEndCapture: {rc})"
        after = snap.stats()
        assert after["skipped"] == st["skipped"] + 1
        assert after["snapshots"] == st["snapshots"]
        assert "capturing a CUDA graph" in caplog.text
        assert snap.state.rng_sources and "cuda" in snap.state.rng_sources
        snap.boundary(2)  # capture over: snapshots again
        assert snap.wait(timeout=60)
        assert snap.stats()["snapshots"] == st["snapshots"] + 1
    finally:
        snap.close()
        if stream.value:
            lib.cudaStreamDestroy(stream)


def test_boundary_inside_a_capture_is_skipped(emu: Any, snap_env: Any, caplog: Any) -> None:
    snap, _ = make_snap(snap_env)
    try:
        st = snap.stats()
        g, static, src = capture_copy(lambda: snap.boundary(1))
        after = snap.stats()
        assert after["skipped"] == st["skipped"] + 1
        assert after["snapshots"] == st["snapshots"]
        assert "the compute stream is capturing a CUDA graph" in caplog.text
        replay_checks(g, static, src)
        snap.boundary(2)
        assert snap.wait(timeout=60)
        assert snap.stats()["snapshots"] == st["snapshots"] + 1
    finally:
        snap.close()


# ------------------------------------------------------------------- item 9
def test_arena_dropped_while_registered_is_unregistered(emu: Any, snap_env: Any) -> None:
    base = emu.counter("pinned_ranges")
    seen: set[int] = set()
    repeats = 0
    for i in range(32):
        path = snap_env.scratch_arena(f"reuse{i}")
        a = make_arena(path, data=4 << 20)
        addr = a.data_ptr(0)
        ok, reason = _C.register_arena(a, 0)
        # a range left registered by a dropped arena: cudaErrorHostMemoryAlreadyRegistered
        assert ok, f"arena {i} at 0x{addr:x} (an address used before: {addr in seen}): {reason}"
        repeats += addr in seen
        seen.add(addr)
        a.unlink()
        del a  # the last reference: ~Arena unregisters, then unmaps
        if repeats >= 2:
            break
    assert repeats >= 2, "no arena was mapped at a reused address: the test proves nothing"
    assert emu.counter("pinned_ranges") == base, "a dropped arena is still registered"


def _gapped_state(n: int = 12) -> tuple[Any, list[Any]]:
    """A model whose parameters lie apart in device memory (a live tensor between each
    two): its copy plan has one range per parameter."""
    torch.cuda.empty_cache()  # fresh segments: the blocks follow the allocation order
    model = torch.nn.Module()
    params, gaps = [], []
    for i in range(n):
        params.append(torch.nn.Parameter(torch.full((4096,), float(i)).cuda()))
        gaps.append(torch.zeros(16384, device="cuda"))  # held: keeps the ranges apart
    model.p = torch.nn.ParameterList(params)
    return model, gaps


@pytest.mark.parametrize("refuse", [0, 801])
def test_the_copies_between_two_marks_go_out_as_one_batch(snap_env: Any, emu: Any,
                                                          refuse: int) -> None:
    """One cudaMemcpyBatchAsync per stretch between progress marks (CUDA 12.8+); a runtime
    or driver that refuses it (801: cudaErrorNotSupported) gets one cudaMemcpyAsync per
    copy from then on, and the snapshot is the same."""
    import cudasnap

    model, gaps = _gapped_state()
    # One chunk (4 MiB) for the 192 KiB state: no progress mark, one stretch of 12 copies
    # (the automatic chunk of a small state puts marks between them, however the allocator
    # laid them out: a stretch may then hold one copy, and nothing to batch).
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, job=snap_env.job,
                                health=False, overhead_budget=0.0, chunk_bytes=4 << 20)
    try:
        emu.fault(f"batch:{refuse}")
        before = emu.counter("cudaMemcpyBatchAsync")
        for step in range(2):
            snap.boundary(step)
            assert snap.wait(timeout=60)
        eng = parts.cuda(snap).engine
        ranges = snap.stats()["layout"]["copy_ranges"]  # (the allocator decides how many)
        assert ranges >= 2
        batches = emu.counter("cudaMemcpyBatchAsync") - before
        if refuse:
            assert not eng.batched and eng.batch_refusal == refuse
            assert batches == 1  # tried once, then one by one
            assert eng.last_memcpy_calls >= ranges
        else:
            assert eng.batched and eng.batch_refusal == 0
            assert batches >= 2 and eng.last_memcpy_calls < ranges, (eng.last_memcpy_calls, ranges)
        path = snap.flush()
        assert path is not None
    finally:
        emu.fault("batch:0")
        snap.close(flush=False)
    fresh, _ = _gapped_state()
    for p in fresh.parameters():
        p.data.copy_(torch.full((4096,), -1.0))
    snap2 = cudasnap.Snapshotter(fresh, None, directory=snap_env.dir, job=snap_env.job + "-b",
                                 health=False, overhead_budget=0.0)
    try:
        assert snap2.restore_latest() == 2
        for i, p in enumerate(fresh.parameters()):
            assert torch.equal(p.detach().cpu(), torch.full((4096,), float(i))), i
    finally:
        snap2.close(flush=False)


def test_a_progress_mark_follows_the_copies_before_it(snap_env: Any, emu: Any) -> None:
    """Each copy is held up (copy_delay_us): a progress mark recorded before the batch of
    copies it is meant to follow would let the checksum of those chunks run on bytes not
    yet copied, and the slot would fail its own CRC32C (read_slot verifies). Mutant:
    ``mark-before-its-batch``."""
    from helpers.slots import read_slot

    import cudasnap

    model, gaps = _gapped_state()  # 12 x 16 KiB apart: several chunks of 64 KiB
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, job=snap_env.job,
                                health=False, overhead_budget=0.0, chunk_bytes=64 << 10)
    try:
        snap.boundary(0)
        assert snap.wait(timeout=60)
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.full((4096,), 100.0 + i))
        want = {f"model.p.{i}": torch.full((4096,), 100.0 + i) for i in range(12)}
        emu.fault("copy_delay_us:20000")
        try:
            snap.boundary(1)
            assert snap.wait(timeout=60)
        finally:
            emu.fault("copy_delay_us:0")
        info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert info["step"] == 1
        for name, t in want.items():
            assert torch.equal(got[name].view(torch.float32), t), name
    finally:
        snap.close(flush=False)
