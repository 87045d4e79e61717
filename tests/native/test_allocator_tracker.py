"""Tests of the allocator registry (cudasnap._C.AllocatorRegistry) with synthetic traces.

The registry is pure C++ (no CUDA): these run everywhere. The CUDA hook that feeds it
from the caching allocator is exercised by the GPU tests in test_cuda_backend.py.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch  # noqa: F401  (loads the libraries _C links against)

from cudasnap import _C
from cudasnap.errors import SnapshotError

MB = 1 << 20
KB = 1 << 10
BASE = 0x7F0000000000


def reg() -> _C.AllocatorRegistry:
    return _C.AllocatorRegistry()


def live(r, dev=0):
    return {(a, s) for a, s, *_ in r.live_blocks(dev)}


def segs(r, dev=0):
    return [(a, s, e) for a, s, e, *_ in r.segments(dev)]


def alloc(r, addr, size, dev=0, stream=0, pool=(0, 0)):
    r.record("alloc", dev, addr, size, stream, pool)


def free(r, addr, size, dev=0):
    r.record("free_requested", dev, addr, size)
    r.record("free_completed", dev, addr, size)


# ------------------------------------------------------------------ basics

def test_action_names_mirror_c10():
    assert _C.trace_actions() == [
        "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
        "segment_map", "segment_unmap", "snapshot", "oom", "annotate", "unknown"]


def test_unknown_action_name_raises():
    with pytest.raises(SnapshotError, match="unknown trace action 'bogus'"):
        reg().record("bogus", 0, 0, 0)


def test_alloc_free_requested_then_completed():
    r = reg()
    r.record("segment_alloc", 0, BASE, 2 * MB)
    alloc(r, BASE, 4096)
    alloc(r, BASE + 4096, 8192, stream=7, pool=(1, 2))
    assert live(r) == {(BASE, 4096), (BASE + 4096, 8192)}
    blocks = {b[0]: b for b in r.live_blocks(0)}
    assert blocks[BASE + 4096][2:] == (7, (1, 2))
    g = r.generation(0)
    r.record("free_requested", 0, BASE, 4096)
    # pending free: no longer live, not locatable, not covered
    assert live(r) == {(BASE + 4096, 8192)}
    assert {(a, s) for a, s, *_ in r.pending_free(0)} == {(BASE, 4096)}
    assert r.generation(0) == g + 1
    res = r.locate(0, [(BASE, 16)])
    assert isinstance(res[0], str) and "pending free" in res[0]
    r.record("free_completed", 0, BASE, 4096)
    assert r.pending_free(0) == []
    assert r.generation(0) == g + 1  # completing a requested free changes no live block
    assert live(r) == {(BASE + 4096, 8192)}
    assert r.stats()["ignored"] == 0


def test_free_completed_without_request_and_unknown_frees():
    r = reg()
    alloc(r, BASE, 512)
    r.record("free_completed", 0, BASE, 512)  # attached between request and completion
    assert live(r) == set()
    r.record("free_requested", 0, BASE + MB, 512)  # never seen: ignored, counted
    r.record("unknown", 0, 0, 0)  # the switch's default: case
    r.record("snapshot", 0, 0, 0)
    r.record("oom", 0, 123, 0)
    r.record("annotate", 0, BASE, 0)
    r.drain()
    st = r.stats()
    assert st["ignored"] == 2 and st["recorded"] == 7 and st["applied"] == 7
    assert st["queued"] == 0 and st["dropped"] == 0 and r.healthy


def test_drain_returns_count_and_queries_drain():
    r = reg()
    for i in range(10):
        alloc(r, BASE + i * 4096, 4096)
    assert r.stats()["queued"] == 10
    assert r.drain() == 10
    assert r.drain() == 0
    alloc(r, BASE + MB, 1)
    assert len(r.live_blocks(0)) == 11  # a query applies what is queued


def test_devices_are_separate():
    r = reg()
    alloc(r, BASE, 4096, dev=0)
    alloc(r, BASE, 8192, dev=1)
    assert live(r, 0) == {(BASE, 4096)}
    assert live(r, 1) == {(BASE, 8192)}
    assert r.devices() == [0, 1]
    assert live(r, 5) == set() and r.generation(5) == 0


# ---------------------------------------------------------------- segments

def test_segment_alloc_free_never_merge():
    r = reg()
    r.record("segment_alloc", 0, BASE, 2 * MB)
    r.record("segment_alloc", 0, BASE + 2 * MB, 2 * MB)  # VA-adjacent, separate cudaMalloc
    assert segs(r) == [(BASE, 2 * MB, False), (BASE + 2 * MB, 2 * MB, False)]
    r.record("segment_free", 0, BASE, 2 * MB)
    assert segs(r) == [(BASE + 2 * MB, 2 * MB, False)]


def test_expandable_segments_map_unmap():
    r = reg()
    page = 20 * MB
    for i in range(3):  # grows page by page: one contiguous segment
        r.record("segment_map", 0, BASE + i * page, page, 5)
    assert segs(r) == [(BASE, 3 * page, True)]
    alloc(r, BASE + 10, 100, stream=5)
    alloc(r, BASE + page + 4096, 100, stream=5)
    alloc(r, BASE + 2 * page + 4096, 100, stream=5)
    # unmap the middle page (its block freed first, as the allocator does)
    free(r, BASE + page + 4096, 100)
    r.record("segment_unmap", 0, BASE + page, page, 5)
    assert segs(r) == [(BASE, page, True), (BASE + 2 * page, page, True)]
    # remap: merges back into one
    r.record("segment_map", 0, BASE + page, page, 5)
    assert segs(r) == [(BASE, 3 * page, True)]
    # a mapping of another stream next to it stays separate
    r.record("segment_map", 0, BASE + 3 * page, page, 6)
    assert len(segs(r)) == 2
    # unmapping a range drops (stale) blocks inside it
    r.record("segment_unmap", 0, BASE + 2 * page, page, 5)
    assert live(r) == {(BASE + 10, 100)}


def test_expandable_adjacent_to_cudamalloc_segment_stays_separate():
    r = reg()
    r.record("segment_alloc", 0, BASE, 2 * MB)
    r.record("segment_map", 0, BASE + 2 * MB, 2 * MB)
    assert segs(r) == [(BASE, 2 * MB, False), (BASE + 2 * MB, 2 * MB, True)]


# -------------------------------------------------------------------- seed

def snap_segment(addr, blocks, expandable=False, stream=0, device=0):
    """A segment as torch.cuda.memory_snapshot() reports it (addresses implicit)."""
    total = sum(s for s, _ in blocks)
    return {"device": device, "address": addr, "total_size": total, "stream": stream,
            "is_expandable": expandable, "segment_pool_id": (0, 0),
            "blocks": [{"size": s, "requested_size": s,
                        "state": "active_allocated" if a else "inactive"} for s, a in blocks]}


def test_seed_adds_preexisting_blocks_and_dedupes():
    r = reg()
    # events seen after attach: a new allocation in a new segment
    r.record("segment_alloc", 0, BASE + 8 * MB, 2 * MB)
    alloc(r, BASE + 8 * MB, MB)
    snapshot = [
        snap_segment(BASE, [(MB, True), (512 * KB, False), (512 * KB, True)]),
        snap_segment(BASE + 8 * MB, [(MB, True), (MB, False)]),  # duplicate of the events
        snap_segment(BASE + 16 * MB, [(2 * MB, True)], device=1),  # other device: skipped
    ]
    g = r.generation(0)
    added = r.seed(0, snapshot)
    assert added == 2
    assert r.seeded(0) and not r.seeded(1)
    assert live(r) == {(BASE, MB), (BASE + MB + 512 * KB, 512 * KB), (BASE + 8 * MB, MB)}
    assert segs(r) == [(BASE, 2 * MB, False), (BASE + 8 * MB, 2 * MB, False)]
    assert r.generation(0) == g + 1
    assert r.seed(0, snapshot) == 0  # idempotent
    assert r.stats()["seeded_blocks"] == 2


def test_seed_trusts_events_for_mentioned_addresses():
    r = reg()
    # A: pre-attach block freed after attach, the snapshot taken before the free was drained
    # B: allocated after attach and freed after the snapshot
    # C: pre-attach block, untouched: must be seeded
    A, B, C = BASE, BASE + MB, BASE + 2 * MB
    r.record("free_requested", 0, A, 4096)
    r.record("free_completed", 0, A, 4096)
    alloc(r, B, 4096)
    free(r, B, 4096)
    snapshot = [{"address": BASE, "total_size": 4 * MB,
                 "blocks": [{"address": A, "size": 4096, "state": "active_allocated"},
                            {"address": B, "size": 4096, "state": "active_allocated"},
                            {"address": C, "size": 4096, "state": "active_allocated"},
                            {"address": C + 4096, "size": 4096, "state": "active_pending_free"}]}]
    assert r.seed(0, snapshot) == 1
    assert live(r) == {(C, 4096)}
    # after seeding, mention tracking stops: events apply normally
    free(r, C, 4096)
    assert live(r) == set()


def test_seed_expandable_segment_subtracts_mentioned_ranges():
    r = reg()
    page = 2 * MB
    # pre-attach mapped [0, 4 pages); after attach: map page 4, unmap page 3
    r.record("segment_map", 0, BASE + 4 * page, page)
    r.record("segment_unmap", 0, BASE + 3 * page, page)
    snap = [snap_segment(BASE, [(4 * page, False)], expandable=True)]  # stale: before the unmap
    r.seed(0, snap)
    assert segs(r) == [(BASE, 3 * page, True), (BASE + 4 * page, page, True)]


def test_seed_with_explicit_allocated_flag():
    r = reg()
    r.seed(0, [{"address": BASE, "total_size": MB,
                "blocks": [{"address": BASE, "size": 4096, "allocated": True}]}])
    assert live(r) == {(BASE, 4096)}


# ----------------------------------------------------------------- coverage

def test_coverage_exact():
    r = reg()
    r.record("segment_alloc", 0, BASE, 20 * MB)
    blocks = [(BASE, MB), (BASE + MB, 2 * MB), (BASE + 3 * MB, 4 * MB), (BASE + 8 * MB, 512)]
    for a, s in blocks:
        alloc(r, a, s)
    alloc(r, BASE + 10 * MB, 4096)
    r.record("free_requested", 0, BASE + 10 * MB, 4096)  # pending free: not live
    spans = [(BASE, MB),                   # block 0 fully
             (BASE + MB + 100, 1000),      # part of block 1
             (BASE + MB + 600, 1000),      # overlapping span: counted once
             (BASE + 15 * MB, 4096)]       # in no live block
    c = r.coverage(0, spans, top_n=2)
    assert c["live_blocks"] == 4
    assert c["live_bytes"] == MB + 2 * MB + 4 * MB + 512
    assert c["covered_bytes"] == MB + 1500
    assert c["uncovered_bytes"] == c["live_bytes"] - c["covered_bytes"]
    assert c["uncovered_blocks"] == 2
    assert c["largest_uncovered"] == [(BASE + 3 * MB, 4 * MB), (BASE + 8 * MB, 512)]
    assert c["span_bytes"] == MB + 1500 + 4096
    assert c["outside_bytes"] == 4096
    assert c["pending_free_blocks"] == 1
    # a span straddling two blocks
    c2 = r.coverage(0, [(BASE + MB - 10, 20)])
    assert c2["covered_bytes"] == 20 and c2["outside_bytes"] == 0
    assert r.coverage(3, [(BASE, 10)])["outside_bytes"] == 10


def test_coverage_random_against_bruteforce():
    rnd = random.Random(7)
    r = reg()
    blocks = []
    addr = BASE
    for _ in range(200):
        addr += rnd.choice([0, 512, 4096])
        size = rnd.randrange(1, 20000)
        blocks.append((addr, size))
        alloc(r, addr, size)
        addr += size
    spans = [(rnd.randrange(BASE, addr), rnd.randrange(0, 30000)) for _ in range(300)]
    covered = set()
    for a, n in spans:
        covered.update(range(a, a + n))
    exp_cov = sum(len(covered.intersection(range(a, a + s))) for a, s in blocks)
    c = r.coverage(0, spans, top_n=1000)
    assert c["covered_bytes"] == exp_cov
    assert c["live_bytes"] == sum(s for _, s in blocks)
    assert c["span_bytes"] == len(covered)
    unc = sorted((b for b in blocks if not covered.intersection(range(b[0], b[0] + b[1]))),
                 key=lambda b: (-b[1], b[0]))
    assert c["largest_uncovered"] == unc


# ------------------------------------------------------------------ locate

def test_locate_and_errors():
    r = reg()
    r.record("segment_alloc", 0, BASE, 2 * MB)
    alloc(r, BASE, 4096)
    alloc(r, BASE + 4096, 4096)
    res = r.locate(0, [(BASE + 8, 100), (BASE + 4096, 4096), (BASE + 4000, 200),
                       (BASE + 3 * MB, 4), (BASE + 5, 0)])
    assert res[0] == (BASE, 4096, BASE, 2 * MB)
    assert res[1] == (BASE + 4096, 4096, BASE, 2 * MB)
    assert isinstance(res[2], str) and res[2].startswith("span 2 [") and "extends past" in res[2]
    assert isinstance(res[3], str) and "span 3" in res[3] and "private CUDA-graph pool" in res[3]
    assert res[4] == (0, 0, 0, 0)  # zero bytes: nothing to locate
    with pytest.raises(SnapshotError, match="span 0 .*not inside any live block"):
        r.locate(1, [(BASE, 4)], strict=True)


# ---------------------------------------------------------------- coalesce

def test_coalesce_within_segment_only():
    r = reg()
    r.record("segment_alloc", 0, BASE, 2 * MB)
    r.record("segment_alloc", 0, BASE + 2 * MB, 2 * MB)  # adjacent in VA
    for a in (BASE, BASE + 8192, BASE + 2 * MB - 4096, BASE + 2 * MB):
        alloc(r, a, 4096)
    spans = [(BASE + 8192, 4096), (BASE, 4096), (BASE + 2 * MB - 4096, 4096),
             (BASE + 2 * MB, 4096)]
    ranges, place = r.coalesce(0, spans, 4096)
    # [BASE, BASE+12288) merged across a 4 KiB gap; the touching pair across the
    # segment boundary is NOT merged
    assert ranges == [(BASE, 12288), (BASE + 2 * MB - 4096, 4096), (BASE + 2 * MB, 4096)]
    assert place == [(0, 8192), (0, 0), (1, 0), (2, 0)]
    # a gap larger than merge_gap splits
    ranges, _ = r.coalesce(0, spans[:2], 4095)
    assert ranges == [(BASE, 4096), (BASE + 8192, 4096)]


def test_coalesce_expandable_contiguous_and_unknown_memory():
    r = reg()
    r.record("segment_map", 0, BASE, 2 * MB)
    r.record("segment_map", 0, BASE + 2 * MB, 2 * MB)  # one segment
    spans = [(BASE + 2 * MB - 100, 100), (BASE + 2 * MB + 50, 10)]
    ranges, _ = r.coalesce(0, spans, 64)
    assert ranges == [(BASE + 2 * MB - 100, 160)]
    # unknown memory: only overlapping spans merge
    X = BASE + 100 * MB
    ranges, place = r.coalesce(0, [(X, 100), (X + 50, 100), (X + 150, 10), (X + 170, 0)], 4096)
    assert ranges == [(X, 150), (X + 150, 10)]
    assert place == [(0, 0), (0, 50), (1, 0), (-1, 0)]


def test_coalesce_falls_back_to_block_without_segment():
    r = reg()
    alloc(r, BASE, 8192)  # seeded block whose segment is unknown
    alloc(r, BASE + 8192, 8192)
    ranges, _ = r.coalesce(0, [(BASE, 100), (BASE + 200, 100), (BASE + 8192, 10)], 4096)
    assert ranges == [(BASE, 300), (BASE + 8192, 10)]


def test_coalesce_random_exactness():
    rnd = random.Random(3)
    r = reg()
    seg_list = []
    a = BASE
    for _ in range(20):
        size = rnd.choice([2 * MB, 4 * MB])
        r.record("segment_alloc", 0, a, size)
        seg_list.append((a, size))
        a += size + rnd.choice([0, 0, 2 * MB])  # often VA-adjacent
    spans = []
    for s, n in seg_list:
        for _ in range(rnd.randrange(1, 8)):
            off = rnd.randrange(0, n - 8192)
            spans.append((s + off, rnd.randrange(1, 8192)))
    gap = 16384
    ranges, place = r.coalesce(0, spans, gap)

    def seg_of(x):
        return next(i for i, (s, n) in enumerate(seg_list) if s <= x < s + n)

    for lo, n in ranges:  # never across segments
        assert seg_of(lo) == seg_of(lo + n - 1)
    for (sa, sn), (ri, off) in zip(spans, place):  # every span lies in its range
        lo, n = ranges[ri]
        assert lo + off == sa and off + sn <= n
    ranges_sorted = sorted(ranges)
    for (a1, n1), (a2, _) in zip(ranges_sorted, ranges_sorted[1:]):
        assert a1 + n1 <= a2  # disjoint
        if seg_of(a1) == seg_of(a2):
            assert a2 - (a1 + n1) > gap  # would have merged otherwise


# ----------------------------------------------------------------- threads

def test_interleaved_recording_threads_exact_live_set():
    r = reg()
    threads, per = 4, 10_000
    expected: list[set] = [set() for _ in range(threads)]
    stop = threading.Event()

    def worker(t):
        rnd = random.Random(t)
        base = BASE + t * (1 << 32)
        mine = expected[t]
        order = []
        n = 0
        while n < per:
            if mine and rnd.random() < 0.45:
                a = order.pop(rnd.randrange(len(order)))
                mine.discard(a)
                r.record("free_requested", 0, a, 256)
                r.record("free_completed", 0, a, 256)
                n += 2
            else:
                a = base + n * 512
                mine.add(a)
                order.append(a)
                r.record("alloc", 0, a, 256)
                n += 1

    def drainer():
        while not stop.is_set():
            r.drain()
            r.generation(0)

    d = threading.Thread(target=drainer)
    d.start()
    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    d.join()
    want = {(a, 256) for s in expected for a in s}
    assert live(r) == want
    st = r.stats()
    assert st["recorded"] == st["applied"] and st["ignored"] == 0 and st["dropped"] == 0


def test_auto_drain_bounds_the_queue():
    r = reg()
    r.start_auto_drain(64)
    try:
        for i in range(5000):
            alloc(r, BASE + i * 512, 512)
        # Signalled by the drain thread after each batch it applies (no polling): a
        # batch moved out of the queue but not yet applied still counts as queued.
        assert r.wait_auto_drained(60.0), r.stats()
        st = r.stats()
        assert st["queued"] < 64
        assert st["applied"] >= 5000 - 64 and st["applied"] + st["queued"] == 5000, st
    finally:
        r.stop_auto_drain()
    assert len(r.live_blocks(0)) == 5000
    r.stop_auto_drain()  # idempotent
    assert r.wait_auto_drained(0.0)  # auto drain off: nothing to wait for


@pytest.mark.slow
def test_queued_counts_a_batch_being_applied():
    """stats() never shows an event as neither queued nor applied (the race that made
    the auto-drain test see queued < 64 with applied == 0 under load)."""
    r = reg()
    r.start_auto_drain(1024)
    stop = threading.Event()
    bad: list[dict] = []

    def watch() -> None:
        while not stop.is_set():
            st = r.stats()
            if st["applied"] + st["queued"] != st["recorded"]:
                bad.append(st)
                return

    t = threading.Thread(target=watch)
    t.start()
    try:
        for i in range(40000):
            alloc(r, BASE + i * 512, 512)
        assert r.wait_auto_drained(60.0)
    finally:
        stop.set()
        t.join()
        r.stop_auto_drain()
    assert not bad, bad[0]
