"""Restore's host copy-back: _C.copy_spans (multi-threaded, every span checked first)
and cudasnap.core.copy_back.copy_into (byte copies natively, the rest with torch copy_)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import cudasnap
from cudasnap.core import copy_back
from cudasnap.errors import SnapshotError


def _src(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)


def test_copy_spans_splits_big_spans_and_copies_every_byte(native_C):
    src = _src(1 << 20)
    a = np.zeros(700_001, np.uint8)  # 171 pieces of 4 KiB, the last one short
    b = np.zeros(3, np.uint8)
    c = np.zeros(10, np.uint8)
    spans = [(a.ctypes.data, 5, a.size), (b.ctypes.data, src.size - 3, 3),
             (c.ctypes.data, 0, 0)]
    moved = native_C.copy_spans(src.ctypes.data, src.size, spans, threads=3, piece_bytes=4096)
    assert moved == a.size + 3
    assert np.array_equal(a, src[5:5 + a.size]) and np.array_equal(b, src[-3:])
    assert not c.any()  # a 0-byte span writes nothing


def test_big_pieces_at_odd_addresses_are_copied_exactly(native_C):
    """Pieces >= 64 KiB take the streaming-store path: unaligned head and tail included."""
    src = _src(3 << 20)
    buf = np.zeros((2 << 20) + 64, np.uint8)
    n = (2 << 20) + 13
    spans = [(buf.ctypes.data + 3, 7, n)]
    assert native_C.copy_spans(src.ctypes.data, src.size, spans, 2, (1 << 20) + 5) == n
    assert np.array_equal(buf[3:3 + n], src[7:7 + n])
    assert not buf[:3].any() and not buf[3 + n:].any()  # not a byte outside the span


def test_streaming_copy_of_4_page_blocks_is_exact_at_every_edge(native_C):
    """The streaming path copies 16 KiB blocks 4 pages at a time, then whole lines, then
    bytes: every head alignment and lengths at and around the block edges."""
    src = _src((1 << 20) + 4096)
    for head in (0, 1, 15, 16, 63):
        for n in ((64 << 10) - 1, (64 << 10), (64 << 10) + 16384 + 5, (256 << 10) + 1,
                  (256 << 10) + 16384 - 1, (256 << 10) + 16384 + 63,
                  (1 << 20) - 64 + 3):
            buf = np.zeros(n + 192, np.uint8)
            at = 64 - (buf.ctypes.data & 63) + head  # dst misaligned by `head` from a line
            spans = [(buf.ctypes.data + at, 11, n)]
            assert native_C.copy_spans(src.ctypes.data, src.size, spans, 1, n) == n
            assert np.array_equal(buf[at:at + n], src[11:11 + n]), (head, n)
            assert not buf[:at].any() and not buf[at + n:].any(), (head, n)


@pytest.mark.parametrize("span, match", [
    (lambda d, n: (d, n - 3, 4), "outside the source buffer"),
    (lambda d, n: (d, n + 1, 0 + 1), "outside the source buffer"),
    (lambda d, n: (d, 2**64 - 1, 2), "outside the source buffer"),
    (lambda d, n: (0, 0, 4), "null destination"),
    (lambda d, n: (2**64 - 2, 0, 4), "wraps around"),
])
def test_bad_span_raises_before_any_byte_is_written(native_C, span, match):
    src = _src(4096)
    good = np.zeros(64, np.uint8)
    bad_dst = np.zeros(8, np.uint8)
    spans = [(good.ctypes.data, 0, good.size), span(bad_dst.ctypes.data, src.size)]
    with pytest.raises(SnapshotError, match=match):
        native_C.copy_spans(src.ctypes.data, src.size, spans, threads=2)
    assert not good.any() and not bad_dst.any()  # checked first: the good span did not run


def test_overlapping_destinations_or_source_are_refused(native_C):
    src = _src(8192)
    dst = np.zeros(100, np.uint8)
    with pytest.raises(SnapshotError, match="spans 0 and 1 overlap"):
        native_C.copy_spans(src.ctypes.data, src.size,
                            [(dst.ctypes.data, 0, 60), (dst.ctypes.data + 50, 0, 50)])
    with pytest.raises(SnapshotError, match="overlaps the source buffer"):
        native_C.copy_spans(src.ctypes.data, src.size, [(src.ctypes.data + 100, 0, 10)])
    assert not dst.any()


def _data_and_views(*shapes: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    numel = [int(np.prod(s)) for s in shapes]
    data = torch.from_numpy(_src(4 * sum(numel)))
    views, off = [], 0
    for s, n in zip(shapes, numel):
        views.append(data[off:off + 4 * n].view(torch.float32).view(s))
        off += 4 * n
    return data, views


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # random bytes hold NaNs


def test_copy_into_matches_copy_for_every_kind_of_destination(native_C):
    data, (v0, v1, v2, v3) = _data_and_views((64, 33), (16, 8), (40,), (8, 4))
    plain = torch.zeros(64, 33)
    param = nn.Parameter(torch.zeros(16, 8))
    transposed = torch.zeros(8, 16).t()  # not contiguous: torch copy_
    shared = torch.zeros(48)  # two overlapping views of one storage: sequential copy_
    over_a, over_b = shared[:40], shared[8:40].view(8, 4)
    pairs = [(plain, v0), (param, v1), (transposed, v1), (over_a, v2), (over_b, v3)]
    want = [d.clone() for d, _ in pairs]
    with torch.no_grad():
        for w, (_, s) in zip(want, pairs):
            w.copy_(s)
    want_shared = torch.zeros(48)
    want_shared[:40].copy_(v2)
    want_shared[8:40].view(8, 4).copy_(v3)
    version = param._version
    moved = copy_back.copy_into(pairs, data, threads=2)
    assert moved == plain.numel() * 4 + param.numel() * 4  # only the byte copies, natively
    for (d, _), w in zip(pairs[:3], want[:3]):
        assert _same_bits(d.detach(), w.detach())
    assert _same_bits(shared, want_shared)
    assert param._version > version  # autograd sees the in-place change, as with copy_


def test_copy_into_leaves_sources_outside_data_to_torch(native_C):
    data, (v0,) = _data_and_views((10,))
    elsewhere = torch.arange(10, dtype=torch.float32)  # not a view of `data`
    a, b = torch.zeros(10), torch.zeros(10)
    assert copy_back.copy_into([(a, v0), (b, elsewhere)], data) == 40
    assert _same_bits(a, v0) and _same_bits(b, elsewhere)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def test_restore_from_shm_uses_the_native_copy_and_is_bitwise(snap_env, monkeypatch):
    m, opt = _model()
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir)
    moved: list[int] = []
    real = copy_back.copy_into
    monkeypatch.setattr(copy_back, "copy_into", lambda *a, **k: moved.append(real(*a, **k)))
    try:
        snap.boundary(0)
        snap.wait()
        want = [t.detach().clone() for t in m.state_dict().values()] + [
            v.clone() for s in opt.state.values() for v in s.values()]
        with torch.no_grad():  # change everything, then roll back
            for p in m.parameters():
                p.add_(1.0)
            for s in opt.state.values():
                for v in s.values():
                    v.add_(1)
        assert snap.rollback() == 1
    finally:
        snap.close()
    got = [t.detach() for t in m.state_dict().values()] + [
        v for s in opt.state.values() for v in s.values()]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    nbytes = sum(t.numel() * t.element_size() for t in want)
    assert sum(moved) == nbytes  # every tensor went through copy_spans


def test_restore_into_a_fresh_optimizer_is_bitwise_and_native(snap_env, monkeypatch):
    """A new process: fresh model, an optimizer without state (load_state_dict path)."""
    m, opt = _model()
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir)
    try:
        snap.boundary(0)
        snap.wait()
        snap.close(keep_arena=True)
    except BaseException:
        snap.close()
        raise
    want = [t.detach().clone() for t in m.state_dict().values()] + [
        v.clone() for s in opt.state.values() for v in s.values()]
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    moved: list[int] = []
    real = copy_back.copy_into
    monkeypatch.setattr(copy_back, "copy_into", lambda *a, **k: moved.append(real(*a, **k)))
    snap2 = cudasnap.Snapshotter(m2, opt2, directory=snap_env.dir)
    try:
        assert snap2.restore_latest() == 1
        assert snap2.last_restore()["source"] == "shm"
    finally:
        snap2.close()
    got = [t.detach() for t in m2.state_dict().values()] + [
        v for s in opt2.state.values() for v in s.values()]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert sum(moved) == sum(t.numel() * t.element_size() for t in want)
