"""The emulator's time and hold points (tools/cudaemu): kernels that take time, hold
points between a stream's data ops, waiters, and the timing model's link rates.

Bounds that a loaded machine cannot break are lower bounds (the emulator sleeps until an
op's modelled end); where an upper bound is the negative control, the modelled time is
long (>= 0.2 s) against the host work (a 4 MiB memmove).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

MiB = 1 << 20


@pytest.fixture
def timing(emu: Any) -> Iterator[Any]:
    """The h200 profile for one test, scaled so that 4 MiB stands for ~11 GB."""
    emu.fault("timing:h200,size_scale:2800,time_scale:1")
    try:
        yield emu
    finally:
        emu.fault("timing:off,size_scale:1")


def modelled_s(nbytes: int, gbps: float, scale: float = 2800) -> float:
    return nbytes * scale / (gbps * 1e9)


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def test_a_kernel_with_a_duration_keeps_its_stream_busy(emu: Any) -> None:
    x = torch.zeros(16, device="cuda")
    s = torch.cuda.Stream()
    emu.fault("kernel_us:0")
    with torch.cuda.stream(s):
        x.add_(1)
    s.synchronize()
    emu.fault("kernel_us:2000000")
    try:
        with torch.cuda.stream(s):
            x.add_(1)
        assert not s.query(), "a 2 s kernel finished at once"
        t0 = time.perf_counter()
        s.synchronize()
        assert time.perf_counter() - t0 > 1.0
    finally:
        emu.fault("kernel_us:0")
    with torch.cuda.stream(s):  # negative control: no duration, done at once after sync
        x.add_(1)
    t0 = time.perf_counter()
    s.synchronize()
    assert time.perf_counter() - t0 < 1.0


def test_busy_ops_take_their_time(emu: Any) -> None:
    s = torch.cuda.Stream()
    assert timed(lambda: emu.busy(s.cuda_stream, 300_000)) >= 0.3


def test_hold_at_stops_between_data_ops_and_lets_markers_run(emu: Any) -> None:
    s = torch.cuda.Stream()
    a = torch.zeros(1024, device="cuda")
    b = torch.zeros(1024, device="cuda")
    src = torch.full((1024,), 5.0).pin_memory()
    e1, e2 = torch.cuda.Event(), torch.cuda.Event()
    emu.hold_at(s.cuda_stream, 1)
    try:
        with torch.cuda.stream(s):
            a.copy_(src, non_blocking=True)
            e1.record()
            b.copy_(src, non_blocking=True)
            e2.record()
        end = time.monotonic() + 30
        while not e1.query():  # the first copy and the marker after it run
            assert time.monotonic() < end, "the hold point stopped the first copy"
            time.sleep(0.005)
        time.sleep(0.05)
        assert not e2.query(), "the second copy ran past the hold point"
    finally:
        emu.release()
    e2.synchronize()
    assert torch.equal(b.cpu(), src) and torch.equal(a.cpu(), src)


def test_waiters_count_what_waits_on_a_held_stream(emu: Any) -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    emu.hold(s1.cuda_stream)
    try:
        with torch.cuda.stream(s1):
            emu.busy(s1.cuda_stream, 1)
            ev.record()
        s2.synchronize()
        time.sleep(0.05)
        assert emu.waiters(s1.cuda_stream) == 0  # negative control: nothing waits yet
        s2.wait_event(ev)
        emu.busy(s2.cuda_stream, 1)
        end = time.monotonic() + 30
        while emu.waiters(s1.cuda_stream) != 1:
            assert time.monotonic() < end, "s2's wait is not counted"
            time.sleep(0.005)
    finally:
        emu.release()
    s2.synchronize()
    assert emu.waiters(s1.cuda_stream) == 0


def test_timing_model_link_rates(timing: Any) -> None:
    n = 4 * MiB
    dev = torch.zeros(n // 4, device="cuda")
    pinned = torch.empty(n // 4).pin_memory()
    pageable = torch.empty(n // 4)
    d2h = modelled_s(n, 55.0)
    t = timed(lambda: pinned.copy_(dev, non_blocking=True))
    assert t >= d2h * 0.99, (t, d2h)
    t_pageable = timed(lambda: pageable.copy_(dev))
    assert t_pageable >= modelled_s(n, 20.0) * 0.99
    assert t_pageable > t  # pageable is slower than pinned


def test_timing_model_copies_share_their_link(timing: Any) -> None:
    n = 4 * MiB
    dev = [torch.zeros(n // 4, device="cuda") for _ in range(2)]
    host = [torch.empty(n // 4).pin_memory() for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    one = modelled_s(n, 55.0)

    def two_d2h() -> None:
        for h, d, s in zip(host, dev, streams):
            with torch.cuda.stream(s):
                h.copy_(d, non_blocking=True)

    assert timed(two_d2h) >= 2 * one * 0.99  # one link: the two copies take turns

    def d2h_and_h2d() -> None:  # negative control: two links run side by side
        with torch.cuda.stream(streams[0]):
            host[0].copy_(dev[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            dev[1].copy_(host[1], non_blocking=True)

    assert timed(d2h_and_h2d) < 1.8 * one
