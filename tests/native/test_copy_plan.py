"""Copy plan (csrc/copy_plan.*) against a brute-force model, and the CPU copy engine."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from cudasnap.errors import SnapshotError, StagingError

ELEM_ALIGN = 16  # largest element size (complex128): ranges start on it


@pytest.fixture
def C(native_C):
    return native_C


def round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def model_plan(spans, chunk, gap, align):
    """Brute-force reference: per (phase, device-then-host) sort, merge, lay out."""
    ra = math.lcm(align, ELEM_ALIGN)
    ranges, offs, cursor, p0 = [], [0] * len(spans), 0, 0
    for phase in (0, 1):
        for host in (False, True):
            idx = sorted((i for i, s in enumerate(spans)
                          if s[2] == phase and s[3] == host and s[1] > 0),
                         key=lambda i: spans[i][0])
            k = 0
            while k < len(idx):
                gs, ge, first = spans[idx[k]][0], spans[idx[k]][0] + spans[idx[k]][1], k
                k += 1
                while k < len(idx) and (spans[idx[k]][0] <= ge + gap if host
                                        else spans[idx[k]][0] < ge):
                    ge = max(ge, spans[idx[k]][0] + spans[idx[k]][1])
                    k += 1
                src = gs - gs % ELEM_ALIGN
                dst = round_up(cursor, ra)
                ranges.append((src, dst, ge - src, phase, host))
                for j in idx[first:k]:
                    offs[j] = dst + spans[j][0] - src
                cursor = dst + ge - src
        if phase == 0:
            cursor = round_up(cursor, align)
            p0 = cursor
    return ranges, offs, cursor, p0


def plan_of(C, spans, chunk=1 << 16, gap=4096, align=4096):
    return C.build_plan([s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans],
                        [s[3] for s in spans], chunk, gap, align)


def check_invariants(plan, spans, gap, align):
    """Properties any correct plan has, independent of the model."""
    ranges = plan.ranges
    offs = plan.tensor_offsets
    assert [r[1] for r in ranges] == sorted(r[1] for r in ranges)
    for a, b in zip(ranges, ranges[1:]):
        assert a[1] + a[2] <= b[1], "ranges overlap in the slot"
    for r in ranges:
        assert r[1] % align == 0 and r[1] % ELEM_ALIGN == 0 and r[0] % ELEM_ALIGN == 0
        assert (r[1] + r[2] <= plan.phase0_bytes) if r[3] == 0 else (r[1] >= plan.phase0_bytes)
    assert plan.phase0_bytes % align == 0 and plan.total_bytes >= plan.phase0_bytes
    last_end = ranges[-1][1] + ranges[-1][2] if ranges else 0
    assert plan.total_bytes == max(last_end, plan.phase0_bytes)
    assert plan.copied_bytes == sum(r[2] for r in ranges)
    assert plan.num_chunks == -(-plan.total_bytes // plan.chunk_bytes)
    for i, (ptr, n, phase, host) in enumerate(spans):
        if n == 0:
            continue
        # The span lies inside exactly one range of its phase and memory space, at the
        # offset that keeps its distance from the range start.
        hits = [r for r in ranges if r[3] == phase and r[4] == host
                and r[0] <= ptr and ptr + n <= r[0] + r[2] and offs[i] == r[1] + ptr - r[0]]
        assert len(hits) == 1, (i, spans[i], offs[i], ranges)
        assert offs[i] % ELEM_ALIGN == ptr % ELEM_ALIGN  # address alignment is preserved
    for phase in (0, 1):
        for host in (False, True):
            rs = sorted((r for r in ranges if r[3] == phase and r[4] == host),
                        key=lambda r: r[0])
            # Unmerged neighbours are more than merge_gap apart (measured on the spans).
            group_end = []
            for r in rs:
                members = [s for s, o in zip(spans, offs) if s[2] == phase and s[3] == host
                           and s[1] > 0 and r[1] <= o < r[1] + r[2]]
                group_end.append((min(s[0] for s in members), max(s[0] + s[1] for s in members)))
            for (s0, e0), (s1, e1) in zip(group_end, group_end[1:]):
                # Device spans merge only on strict overlap (never across allocations).
                assert s1 > e0 + gap if host else s1 >= e0


@pytest.mark.parametrize("case,expect_ranges", [
    ("adjacent", 1), ("overlapping", 1), ("contained", 1), ("small-gap", 1), ("big-gap", 2),
    ("zero-size", 1), ("tied-same-ptr", 1),
])
def test_coalescing_cases(C, case, expect_ranges):
    base = 1 << 32
    spans = {
        "adjacent": [(base, 4096, 1, True), (base + 4096, 100, 1, True)],
        "overlapping": [(base, 5000, 1, True), (base + 4000, 3000, 1, True)],
        "contained": [(base, 10000, 1, True), (base + 16, 64, 1, True)],
        "small-gap": [(base, 1000, 1, True), (base + 1000 + 4096, 8, 1, True)],
        "big-gap": [(base, 1000, 1, True), (base + 1000 + 4097, 8, 1, True)],
        "zero-size": [(base, 64, 1, True), (base + 10 ** 9, 0, 1, True)],
        "tied-same-ptr": [(base, 256, 1, True), (base, 256, 1, True)],
    }[case]
    plan = plan_of(C, spans)
    assert plan.num_ranges == expect_ranges
    check_invariants(plan, spans, 4096, 4096)
    ranges, offs, total, p0 = model_plan(spans, 1 << 16, 4096, 4096)
    assert [tuple(r) for r in plan.ranges] == ranges and list(plan.tensor_offsets) == offs
    if case == "big-gap":
        # Two copies; the second starts on the next aligned slot offset.
        assert plan.ranges[1][1] == 4096 and plan.tensor_offsets[1] == 4096 + (base + 5097) % 16
    if case == "small-gap":
        assert plan.copied_bytes == 1000 + 4096 + 8  # the gap is copied, not skipped


@pytest.mark.parametrize("case,expect_ranges", [
    ("touching", 2), ("small-gap", 2), ("overlapping", 1), ("contained", 1), ("same-ptr", 1),
])
def test_device_spans_merge_only_on_strict_overlap(C, case, expect_ranges):
    """Two device allocations back to back in the address space are two copies:
    one cudaMemcpyAsync across their boundary could read a block freed (or a
    segment unmapped) under the copy. Views of one storage (overlap) still merge."""
    base = 1 << 40
    spans = {
        "touching": [(base, 4096, 1, False), (base + 4096, 512, 1, False)],
        "small-gap": [(base, 1000, 1, False), (base + 1024, 512, 1, False)],
        "overlapping": [(base, 5000, 1, False), (base + 4096, 3000, 1, False)],
        "contained": [(base, 10000, 1, False), (base + 16, 64, 1, False)],
        "same-ptr": [(base, 256, 1, False), (base, 256, 1, False)],
    }[case]
    for gap in (0, 4096):
        plan = plan_of(C, spans, gap=gap)
        assert plan.num_ranges == expect_ranges, (case, gap, plan.ranges)
        check_invariants(plan, spans, gap, 4096)
        ranges, offs, _, _ = model_plan(spans, 1 << 16, gap, 4096)
        assert [tuple(r) for r in plan.ranges] == ranges and list(plan.tensor_offsets) == offs
    # The allocator registry's same-segment ranges reach build_plan already merged:
    # a segment's merged range is one copy even next to another segment.
    seg = [(base, 8192, 1, False), (base + 8192, 8192, 1, False)]
    assert plan_of(C, seg, gap=0).num_ranges == 2


def test_phases_and_memory_spaces_are_separated(C):
    base = 1 << 40
    spans = [
        (base + 0x800, 512, 1, True),     # host param near the next one: merged with it
        (base, 512, 0, True),            # host buffer (phase 0) adjacent region
        (base + 512, 512, 1, True),       # host param right after the buffer: not merged
        (base + 0x100000, 256, 1, False),  # device param
        (base + 0x100100, 256, 0, False),  # device buffer adjacent to it: not merged
    ]
    plan = plan_of(C, spans)
    check_invariants(plan, spans, 4096, 4096)
    kinds = [(r[3], r[4]) for r in plan.ranges]
    # phase 0 first (device before host), then phase 1 (device before host)
    assert kinds == [(0, False), (0, True), (1, False), (1, True)]
    assert plan.phase0_bytes == 2 * 4096
    assert plan.tensor_offsets[0] - plan.tensor_offsets[2] == 0x800 - 512  # one host group
    assert plan.ranges[3][2] == 0x800 + 512 - 512


def test_plan_matches_brute_force_model_on_random_span_sets(C):
    rnd = random.Random(1234)
    for trial in range(250):
        n = rnd.randint(0, 24)
        align = rnd.choice([4096, 4096, 512, 64])
        chunk = align * rnd.choice([1, 2, 16])
        gap = rnd.choice([0, 16, 4096, 100000])
        base = rnd.choice([1 << 30, (1 << 44) + 8])
        spans = []
        for _ in range(n):
            if spans and rnd.random() < 0.3:  # views / neighbours of an earlier span
                p, m, _, _ = rnd.choice(spans)
                ptr = p + rnd.randint(0, m + 64) // 2 * 2
            else:
                ptr = base + rnd.randint(0, 1 << 22) // 4 * 4
            spans.append((ptr, rnd.choice([0, 1, 4, 100, 4096, rnd.randint(1, 300000)]),
                          rnd.randint(0, 1), rnd.random() < 0.7))
        plan = plan_of(C, spans, chunk, gap, align)
        ranges, offs, total, p0 = model_plan(spans, chunk, gap, align)
        assert [tuple(r) for r in plan.ranges] == ranges, trial
        assert list(plan.tensor_offsets) == offs, trial
        assert (plan.total_bytes, plan.phase0_bytes, plan.chunk_bytes) == (total, p0, chunk)
        check_invariants(plan, spans, gap, align)


def test_bad_plan_arguments(C):
    with pytest.raises(SnapshotError, match="multiple of align"):
        C.build_plan([1], [1], [1], [True], 5000, 4096, 4096)
    with pytest.raises(SnapshotError, match="phase 2"):
        C.build_plan([1], [1], [2], [True], 4096, 4096, 4096)
    with pytest.raises(SnapshotError, match="differ in length"):
        C.build_plan([1, 2], [1], [1], [True], 4096, 4096, 4096)
    empty = C.build_plan([], [], [], [], 4096, 4096, 4096)
    assert (empty.total_bytes, empty.num_chunks, empty.num_ranges) == (0, 0, 0)


# ------------------------------------------------------------ CPU engine

def _arena(C, env, name, cap, chunk, slots=2):
    return C.Arena.create(str(env.scratch_arena(name)), slots, cap, 4096, chunk, env.job, True)


def _random_spans(rnd, buf_len, n, max_len):
    spans = []
    for _ in range(n):
        m = rnd.randint(1, max_len)
        off = rnd.randint(0, buf_len - m)
        spans.append((off, m, rnd.randint(0, 1)))
    return spans


def _slot_bytes(arena, slot, n):
    return np.frombuffer(arena.data_view(slot, n), dtype=np.uint8).copy() if n else \
        np.zeros(0, np.uint8)


def test_cpu_engine_copies_exact_bytes_for_random_span_sets(C, snap_env):
    rnd = random.Random(99)
    nrng = np.random.default_rng(99)
    src = nrng.integers(0, 256, 3 << 20, dtype=np.uint8)
    base = src.ctypes.data
    chunk = 64 << 10
    arena = _arena(C, snap_env, "eng", 8 << 20, chunk)
    eng = C.CpuCopyEngine(3)
    try:
        for trial in range(12):
            spans = _random_spans(rnd, len(src), rnd.randint(1, 40),
                                  rnd.choice([64, 5000, 300000]))
            plan = C.build_plan([base + o for o, _, _ in spans], [m for _, m, _ in spans],
                                [p for _, _, p in spans], [True] * len(spans), chunk, 4096, 4096)
            slot = arena.pick_write_slot()
            job = eng.submit(arena, slot, plan, trial, b'{"t":%d}' % trial)
            assert job.wait(1, 60.0) and job.done(0) and job.done(1) and not job.failed
            assert (job.slot, job.step, job.bytes) == (slot, trial, plan.total_bytes)
            info = arena.slot_info(slot)
            assert info["valid"] and info["step"] == trial
            assert info["data_bytes"] == plan.total_bytes and arena.newest_complete() == slot
            got = _slot_bytes(arena, slot, plan.total_bytes)
            for (o, m, _), off in zip(spans, plan.tensor_offsets):
                assert np.array_equal(got[off:off + m], src[o:o + m]), (trial, o, m, off)
            covered = np.zeros(plan.total_bytes, bool)
            for s, d, n, _, _ in plan.ranges:
                covered[d:d + n] = True
                assert np.array_equal(got[d:d + n], src[s - base:s - base + n])
            assert not got[~covered].any()  # alignment padding is zeroed, not stale
            table = arena.read_table(slot)
            assert table == [C.crc32c(got[i:i + chunk]) for i in range(0, len(got), chunk)]
            assert C.verify_buffer(arena.data_ptr(slot), plan.total_bytes, chunk, table, 2) == -1
            assert arena.read_meta(slot) == b'{"t":%d}' % trial
    finally:
        eng.shutdown()


def test_phase0_is_done_before_phase1(C, snap_env):
    """After wait(0) the buffers may be written (next forward) without touching the
    snapshot; parameters only after wait(1)."""
    nrng = np.random.default_rng(7)
    buffers = nrng.integers(0, 256, 200 << 10, dtype=np.uint8)
    params = nrng.integers(0, 256, 24 << 20, dtype=np.uint8)
    want_buf, want_par = buffers.copy(), params.copy()
    chunk = 256 << 10
    plan = C.build_plan([params.ctypes.data, buffers.ctypes.data], [params.size, buffers.size],
                        [1, 0], [True, True], chunk, 4096, 4096)
    off_par, off_buf = plan.tensor_offsets
    assert off_buf == buffers.ctypes.data % 16 and off_par >= plan.phase0_bytes
    arena = _arena(C, snap_env, "ph", plan.total_bytes, chunk)
    eng = C.CpuCopyEngine(1)
    try:
        for rep in range(2):
            job = eng.submit(arena, arena.pick_write_slot(), plan, rep, b"{}")
            assert job.wait(0, 60.0) and job.done(0)
            buffers[:] = 255 - buffers  # "the next forward" updates running stats
            assert job.wait(1, 60.0)
            got = _slot_bytes(arena, job.slot, plan.total_bytes)
            assert np.array_equal(got[off_buf:off_buf + buffers.size], want_buf)
            assert np.array_equal(got[off_par:off_par + params.size], want_par)
            want_buf = buffers.copy()
    finally:
        eng.shutdown()


def test_engine_refuses_bad_submissions(C, snap_env):
    src = np.zeros(10000, np.uint8)
    arena = _arena(C, snap_env, "bad", 8192, 4096)
    eng = C.CpuCopyEngine(1)
    try:
        dev = C.build_plan([1 << 40], [100], [1], [False], 4096, 4096, 4096)
        with pytest.raises(SnapshotError, match="cannot read device memory"):
            eng.submit(arena, 0, dev, 1, b"{}")
        other_chunk = C.build_plan([src.ctypes.data], [100], [1], [True], 8192, 4096, 4096)
        with pytest.raises(StagingError, match="chunk size"):
            eng.submit(arena, 0, other_chunk, 1, b"{}")
        too_big = C.build_plan([src.ctypes.data], [10000], [1], [True], 4096, 4096, 4096)
        with pytest.raises(StagingError, match="arena slots hold"):
            eng.submit(arena, 0, too_big, 1, b"{}")
        assert arena.slot_info(0)["state"] == "EMPTY"  # nothing was begun
        empty = C.build_plan([], [], [], [], 4096, 4096, 4096)
        job = eng.submit(arena, 1, empty, 5, b"{}")
        assert job.wait(1, 10.0) and arena.slot_info(1)["valid"]
        assert arena.slot_info(1)["data_bytes"] == 0
    finally:
        eng.shutdown()
    with pytest.raises(SnapshotError, match="shut down"):
        eng.submit(arena, 0, empty, 6, b"{}")
    with pytest.raises(SnapshotError, match="1..256"):
        C.CpuCopyEngine(0)
