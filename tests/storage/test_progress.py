"""Progress bars read the flusher's own byte counters (_C.io_bytes), not /proc/self/io."""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest

from cudasnap._native import native
from cudasnap.storage import progress

tqdm = pytest.importorskip("tqdm")


def test_io_bytes_count_the_flushers_writes_and_reads(tmp_path):
    C = native()
    n, chunk = 3 * 65536 + 100, 4096
    buf = (ctypes.c_uint8 * n)(*([7] * n))
    w0, r0 = C.io_bytes()
    st = C.write_buffer_file(ctypes.addressof(buf), n, chunk, str(tmp_path / "d"), threads=3,
                             durable=False)
    w1, r1 = C.io_bytes()
    assert (w1 - w0, r1 - r0) == (n, 0)
    dst = (ctypes.c_uint8 * n)()
    C.read_file_verified(str(tmp_path / "d"), ctypes.addressof(dst), n, chunk, st["crc32c"], 2)
    w2, r2 = C.io_bytes()
    assert (w2 - w1, r2 - r1) == (0, n)
    assert bytes(dst) == bytes(buf)
    # Python-level I/O of this process is not the flusher's: the counters stay put.
    (tmp_path / "other").write_bytes(b"x" * (1 << 20))
    (tmp_path / "other").read_bytes()
    assert C.io_bytes() == (w2, r2)


@pytest.fixture
def tty(monkeypatch):
    monkeypatch.setattr(progress, "enabled", lambda total, min_bytes=0: True)
    monkeypatch.setattr(progress, "POLL_S", 0.01)


def test_bar_follows_the_counter_to_total(tty):
    count = [1000]  # a counter that does not start at 0
    with progress.io_progress(4096, "t", lambda: count[0]) as bar:
        assert bar is not None and bar.total == 4096
        count[0] += 1024
        seen = threading.Event()
        for _ in range(500):  # the polling thread picks it up
            if bar.n == 1024:
                seen.set()
                break
            threading.Event().wait(0.01)
        assert seen.is_set(), bar.n
        count[0] += 10_000  # more than total: capped
    assert bar.n == 4096


def test_bar_ignores_other_io_and_uses_native_counters(tty, tmp_path: Path):
    C = native()
    n = 256 << 10
    buf = (ctypes.c_uint8 * n)()
    with progress.io_progress(n, "flush", progress.bytes_written) as bar:
        (tmp_path / "noise").write_bytes(b"y" * (4 << 20))  # not the flusher's I/O
        C.write_buffer_file(ctypes.addressof(buf), n // 2, 4096, str(tmp_path / "d"),
                            durable=False)
    assert bar.n == n // 2
    with progress.io_progress(n, "restore", "read") as bar:
        (tmp_path / "noise").read_bytes()
    assert bar.n == 0


def test_bad_counter_is_named():
    with pytest.raises(ValueError, match="counter must be a callable"):
        with progress.io_progress(1, "x", "sideways"):  # type: ignore[arg-type]
            pass
