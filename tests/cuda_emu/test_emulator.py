"""The emulated CUDA runtime itself (tools/cudaemu) behaves as the CUDA documentation says
where cudasnap depends on it: stream order, events, pinned vs pageable copies, host
registration, capture modes, the legacy stream's implicit synchronisation, graph
replay and sticky errors. A lane whose emulator got these wrong would pass vacuously.

Runtime calls go straight to the preloaded emulator through ctypes.
"""
from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

SUCCESS, NOT_READY, ILLEGAL_ADDRESS = 0, 600, 700
ALREADY_REGISTERED, NOT_REGISTERED = 712, 713
CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED, CAPTURE_IMPLICIT = 900, 901, 906
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2
H2D, D2H = 1, 2
NON_BLOCKING = 1

rt = ctypes.CDLL(None)
vp, sz = ctypes.c_void_p, ctypes.c_size_t
for name, args in {
    "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
    "cudaStreamBeginCapture": [vp, ctypes.c_int],
    "cudaStreamEndCapture": [vp, ctypes.POINTER(vp)],
    "cudaStreamIsCapturing": [vp, ctypes.POINTER(ctypes.c_int)],
    "cudaStreamSynchronize": [vp],
    "cudaStreamWaitEvent": [vp, vp, ctypes.c_uint],
    "cudaEventCreate": [ctypes.POINTER(vp)],
    "cudaEventRecord": [vp, vp],
    "cudaEventQuery": [vp],
    "cudaMemcpyAsync": [vp, vp, sz, ctypes.c_int, vp],
    "cudaMalloc": [ctypes.POINTER(vp), sz],
    "cudaHostAlloc": [ctypes.POINTER(vp), sz, ctypes.c_uint],
    "cudaHostRegister": [vp, sz, ctypes.c_uint],
    "cudaHostUnregister": [vp],
    "cudaThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
    "cudaGraphDestroy": [vp],
}.items():
    getattr(rt, name).argtypes = args


@pytest.fixture(autouse=True)
def _no_stale_error() -> Iterator[None]:
    """The errors these tests provoke are also each thread's last error (as in CUDA):
    read it away so that torch's next launch check does not report it."""
    yield
    rt.cudaGetLastError()


def stream(flags: int = NON_BLOCKING) -> ctypes.c_void_p:
    s = vp()
    assert rt.cudaStreamCreateWithFlags(ctypes.byref(s), flags) == SUCCESS
    return s


def event() -> ctypes.c_void_p:
    e = vp()
    assert rt.cudaEventCreate(ctypes.byref(e)) == SUCCESS
    return e


def dmalloc(n: int) -> int:
    p = vp()
    assert rt.cudaMalloc(ctypes.byref(p), n) == SUCCESS
    return int(p.value)


def halloc(n: int) -> tuple[int, ctypes.Array]:
    p = vp()
    assert rt.cudaHostAlloc(ctypes.byref(p), n, 0) == SUCCESS
    return int(p.value), (ctypes.c_ubyte * n).from_address(int(p.value))


def set_mode(mode: int) -> int:
    m = ctypes.c_int(mode)
    assert rt.cudaThreadExchangeStreamCaptureMode(ctypes.byref(m)) == SUCCESS
    return m.value


def test_event_orders_one_stream_behind_another(emu: Any) -> None:
    torch.cuda.init()
    n = 1 << 16
    a, b = stream(), stream()
    src, src_buf = halloc(n)
    dst, dst_buf = halloc(n)
    dev = dmalloc(n)
    ctypes.memset(src, 0x5A, n)
    ev = event()
    emu.hold(a.value)  # a's copy stays queued until released: deterministically in flight
    try:
        assert rt.cudaMemcpyAsync(dev, src, n, H2D, a) == SUCCESS
        assert rt.cudaEventRecord(ev, a) == SUCCESS
        assert rt.cudaEventQuery(ev) == NOT_READY  # pinned: the call returned before the copy
        assert rt.cudaStreamWaitEvent(b, ev, 0) == SUCCESS
        assert rt.cudaMemcpyAsync(dst, dev, n, D2H, b) == SUCCESS  # must wait for a's copy
        time.sleep(0.05)
        assert dst_buf[0] == 0  # b is waiting, not copying
    finally:
        emu.release()
    assert rt.cudaStreamSynchronize(b) == SUCCESS
    assert rt.cudaEventQuery(ev) == SUCCESS
    assert bytes(dst_buf[:4]) == b"\x5a" * 4 and dst_buf[n - 1] == 0x5A


def test_without_the_wait_the_second_stream_runs_ahead(emu: Any) -> None:
    """Negative control of the test above: the ordering came from the event wait."""
    torch.cuda.init()
    n = 1 << 16
    a, b = stream(), stream()
    src, _ = halloc(n)
    dst, dst_buf = halloc(n)
    dev = dmalloc(n)
    ctypes.memset(dev, 0, n)  # emulated device memory is host memory
    ctypes.memset(src, 0x5A, n)
    emu.hold(a.value)
    try:
        assert rt.cudaMemcpyAsync(dev, src, n, H2D, a) == SUCCESS
        assert rt.cudaMemcpyAsync(dst, dev, n, D2H, b) == SUCCESS
        assert rt.cudaStreamSynchronize(b) == SUCCESS
        assert dst_buf[0] == 0  # b did not wait for a
    finally:
        emu.release()
    assert rt.cudaStreamSynchronize(a) == SUCCESS


def test_pageable_copies_complete_before_returning(emu: Any) -> None:
    torch.cuda.init()
    n = 4096
    s = stream()
    dev = dmalloc(n)
    host = (ctypes.c_ubyte * n)()
    ctypes.memset(dev, 7, n)
    emu.fault("copy_delay_us:30000")
    t0 = time.perf_counter()
    assert rt.cudaMemcpyAsync(ctypes.addressof(host), dev, n, D2H, s) == SUCCESS
    assert time.perf_counter() - t0 >= 0.025  # waited for its own (delayed) copy
    assert host[0] == 7 and host[n - 1] == 7


def test_host_registration_rules(emu: Any) -> None:
    torch.cuda.init()
    m = mmap.mmap(-1, 1 << 20)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    try:
        assert rt.cudaHostRegister(addr, 1 << 20, 0) == SUCCESS
        assert emu.is_pinned(addr, 1 << 20)
        assert rt.cudaHostRegister(addr + 4096, 4096, 0) == ALREADY_REGISTERED
        assert rt.cudaHostUnregister(addr) == SUCCESS
        assert rt.cudaHostUnregister(addr) == NOT_REGISTERED
        assert not emu.is_pinned(addr, 1)
        emu.fault("host_register:801")
        assert rt.cudaHostRegister(addr, 1 << 20, 0) == 801
    finally:
        emu.fault("clear")
        del addr
        import gc

        gc.collect()
        m.close()


def _capture_in_thread(mode: int, during: Any) -> tuple[int, Any]:
    """Begins a capture of `mode` on a non-blocking stream in another thread, runs
    `during()` here while it is open, then ends it there: (end status, during's result)."""
    s = stream()
    begun, finish = threading.Event(), threading.Event()
    out: dict[str, int] = {}

    def capturer() -> None:
        out["begin"] = rt.cudaStreamBeginCapture(s, mode)
        begun.set()
        finish.wait(10)
        g = vp()
        out["end"] = rt.cudaStreamEndCapture(s, ctypes.byref(g))
        if g.value:
            rt.cudaGraphDestroy(g)

    t = threading.Thread(target=capturer)
    t.start()
    assert begun.wait(10) and out["begin"] == SUCCESS
    try:
        res = during()
    finally:
        finish.set()
        t.join(10)
    return out["end"], res


def test_global_capture_refuses_an_event_query_from_another_thread(emu: Any) -> None:
    torch.cuda.init()
    ev = event()
    end, q = _capture_in_thread(GLOBAL, lambda: rt.cudaEventQuery(ev))
    assert q == CAPTURE_UNSUPPORTED
    assert end == CAPTURE_INVALIDATED  # the prohibited call invalidated the capture


def test_relaxed_or_thread_local_callers_leave_the_capture_alone(emu: Any) -> None:
    torch.cuda.init()
    ev = event()

    def relaxed_query() -> int:
        old = set_mode(RELAXED)
        try:
            return int(rt.cudaEventQuery(ev))
        finally:
            set_mode(old)

    end, q = _capture_in_thread(GLOBAL, relaxed_query)
    assert (end, q) == (SUCCESS, SUCCESS)
    # A thread-local capture in another thread does not restrict this (global) thread.
    end, q = _capture_in_thread(THREAD_LOCAL, lambda: rt.cudaEventQuery(ev))
    assert (end, q) == (SUCCESS, SUCCESS)


def test_legacy_stream_reports_implicit_capture_of_a_blocking_stream(emu: Any) -> None:
    torch.cuda.init()
    blocking = stream(0)
    status = ctypes.c_int(-1)
    assert rt.cudaStreamBeginCapture(blocking, GLOBAL) == SUCCESS
    try:
        assert rt.cudaStreamIsCapturing(None, ctypes.byref(status)) == CAPTURE_IMPLICIT
        assert rt.cudaStreamIsCapturing(blocking, ctypes.byref(status)) == SUCCESS
        assert status.value == 1  # cudaStreamCaptureStatusActive
    finally:
        g = vp()
        rt.cudaStreamEndCapture(blocking, ctypes.byref(g))
    assert rt.cudaStreamIsCapturing(None, ctypes.byref(status)) == SUCCESS and status.value == 0


def test_torch_graph_capture_and_replay(emu: Any) -> None:
    """torch.cuda.graph records the copy; replays repeat it with the current source bytes."""
    static = torch.empty(4, device="cuda")
    src = torch.zeros(4).pin_memory()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static.copy_(src, non_blocking=True)
    for v in (3.0, 7.0):
        src.fill_(v)
        g.replay()
        torch.cuda.synchronize()
        assert static.cpu().tolist() == [v] * 4
    assert emu.counter("captures") == 0


def test_sticky_error_poisons_every_later_call(emu: Any) -> None:
    code = """
import ctypes, torch
lib = ctypes.CDLL(None)
x = torch.ones(4).cuda()
n = lib.cudaemu_counter(b"cudaMemcpyAsync")
lib.cudaemu_fault(f"sticky:cudaMemcpyAsync:{n + 1}".encode())
errs = []
for f in (lambda: x.cpu(), lambda: torch.cuda.synchronize(), lambda: torch.empty(8, device="cuda")):
    try:
        f()
        errs.append("ok")
    except RuntimeError as e:
        errs.append("illegal memory access" in str(e))
print(errs)
lib.cudaGetLastError.restype = ctypes.c_int
print(lib.cudaGetLastError(), lib.cudaGetLastError())
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-2] == "[True, True, True]", p.stdout
    assert lines[-1] == f"{ILLEGAL_ADDRESS} {ILLEGAL_ADDRESS}"  # not cleared by reading it
