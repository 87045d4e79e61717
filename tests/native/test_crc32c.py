"""CRC32C implementations (csrc/crc32c.*): the 3-way interleaved SSE4.2 form, the
single-chain form and the portable tables must give the exact Castagnoli CRC."""
from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import parts

from tools.faults import layout as L


@pytest.fixture
def C(native_C):
    return native_C


def impls(C) -> list[str]:
    out = ["portable"]
    if C.crc32c_hardware():
        out += ["sse42_1way", "sse42_3way"]
    return out


def ext_crc_funcs() -> dict[str, object]:
    """The PyPI packages as independent references, where installed."""
    out: dict[str, object] = {}
    try:
        import crc32c as pkg

        out["crc32c"] = pkg.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        out["google-crc32c"] = google_crc32c.value
    except ImportError:
        pass
    return out


# Lengths around every boundary of the 3-way code: the 8-byte alignment head, the
# 3 x 256 and 3 x 8192 blocks and their multiples, and the 1-way tail.
EDGE_LENGTHS = sorted({0, 1, 7, 8, 9, 63, 255, 256, 257, 767, 768, 769, 775, 776, 1535, 1536,
                       1544, 24575, 24576, 24577, 24583, 24576 + 768, 24576 + 767,
                       2 * 24576 + 3 * 768 + 13, 4 << 20, (4 << 20) + 5})


def test_known_vectors_every_impl(C):
    vectors = {b"123456789": 0xE3069283, b"": 0, bytes(32): 0x8A9136AA,
               b"\xff" * 32: 0x62A8AB43, bytes(range(32)): 0x46DD794E,
               bytes(range(31, -1, -1)): 0x113FDB5C}
    for impl in impls(C):
        for data, want in vectors.items():
            assert parts.crc32c_impl(C, data, impl) == want, (impl, data[:10])
    assert C.crc32c(b"123456789") == 0xE3069283


def test_every_impl_agrees_on_lengths_and_alignments(C):
    rng = np.random.default_rng(11)
    big = rng.integers(0, 256, (4 << 20) + 64, dtype=np.uint8)
    mv = memoryview(big)
    for n in EDGE_LENGTHS:
        for off in (0, 1, 3, 7):
            view = mv[off:off + n]
            want = parts.crc32c_impl(C, view, "portable")
            for impl in impls(C):
                assert parts.crc32c_impl(C, view, impl) == want, (impl, n, off)
            assert C.crc32c(view) == want, (n, off)
    # the textbook bytewise definition on small inputs
    for n in (0, 5, 100, 800, 3000):
        data = bytes(big[7:7 + n])
        assert parts.crc32c_impl(C, data, "portable") == L.crc32c_ref(data)


def test_random_lengths_vs_portable_and_packages(C):
    rnd = random.Random(7)
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    ext = ext_crc_funcs()
    for _ in range(200):
        off = rnd.randrange(0, 64)
        n = rnd.choice([rnd.randrange(0, 2000), rnd.randrange(0, 100_000),
                        rnd.randrange(0, len(buf) - 64)])
        view = memoryview(buf)[off:off + n]
        want = parts.crc32c_impl(C, view, "portable")
        got = C.crc32c(view)
        assert got == want, (n, off)
        for name, fn in ext.items():
            assert fn(bytes(view)) == want, (name, n, off)


def test_packages_agree_on_a_large_buffer(C):
    ext = ext_crc_funcs()
    if not ext:
        pytest.skip("neither the crc32c nor the google-crc32c package is installed "
                    "(requirements-dev.txt lists them)")
    data = np.random.default_rng(3).integers(0, 256, (8 << 20) + 123, dtype=np.uint8).tobytes()
    ours = C.crc32c(data)
    for name, fn in ext.items():
        assert fn(data) == ours, name


def test_continuation_across_any_split(C):
    rnd = random.Random(9)
    data = np.random.default_rng(5).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    for impl in impls(C):
        whole = parts.crc32c_impl(C, data, impl)
        for _ in range(30):
            cut = rnd.randrange(0, len(data) + 1)
            head = parts.crc32c_impl(C, data[:cut], impl)
            assert parts.crc32c_impl(C, data[cut:], impl, head) == whole, (impl, cut)
        assert C.crc32c(data[cut:], C.crc32c(data[:cut])) == whole


def test_unknown_impl_is_a_clear_error(C):
    with pytest.raises(ValueError, match="crc32c implementation 'avx9000'"):
        parts.crc32c_impl(C, b"x", "avx9000")


def test_copy_copies_and_checksums_like_memcpy_then_crc(C):
    """crc32c_copy (the CPU copy engine's fused chunk copy) == memcpy + crc32c, on every
    edge of the 3-way code, unaligned source and destination, with a running CRC."""
    rng = np.random.default_rng(13)
    src = rng.integers(0, 256, (4 << 20) + 64, dtype=np.uint8)
    for n in EDGE_LENGTHS:
        for soff, doff in ((0, 0), (1, 0), (3, 5), (7, 1)):
            dst = np.full(n + 16, 0xA5, dtype=np.uint8)
            view = memoryview(src)[soff:soff + n]
            want = parts.crc32c_impl(C, view, "portable", 0x1234ABCD)
            got = C.crc32c_copy(memoryview(dst)[doff:doff + n], view, 0x1234ABCD)
            assert got == want, (n, soff, doff)
            assert bytes(dst[doff:doff + n]) == bytes(view), (n, soff, doff)
            assert not (dst[:doff] != 0xA5).any() and not (dst[doff + n:] != 0xA5).any()


def test_copy_refuses_a_short_overlapping_or_read_only_destination(C):
    from cudasnap import SnapshotError

    buf = np.zeros(100, dtype=np.uint8)
    with pytest.raises(SnapshotError, match="destination holds 10 bytes, source 20"):
        C.crc32c_copy(memoryview(buf)[:10], memoryview(buf)[50:70])
    with pytest.raises(SnapshotError, match="overlap"):
        C.crc32c_copy(memoryview(buf)[10:40], memoryview(buf)[0:20])
    with pytest.raises((BufferError, TypeError, ValueError)):
        C.crc32c_copy(b"\0" * 20, memoryview(buf)[0:20])
