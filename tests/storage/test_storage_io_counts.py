"""Progress counters move for object-store flushes and restores (issue 12).

``tools.progress.bytes_written()``/``bytes_read()`` fed only the C++ flusher's counters
(``_C.io_bytes()``), but the fsspec storage uploads and downloads its data objects in
Python: a progress bar of an ``s3://`` flush or restore never moved. The storage now
counts its data bytes (``cudasnap.storage.counters``) and the progress counters add
them. Run against the local S3 server of tests/storage/test_s3.py (moto, on 127.0.0.1).
"""
from __future__ import annotations

import threading

import pytest
import test_s3
import torch

from tools.faults.trainlib import train

pytest.importorskip("s3fs", reason="s3fs not installed (pip install 'cudasnap[s3]')")
pytest.importorskip("moto.server", reason="moto[server] not installed (requirements-dev.txt)")

import cudasnap  # noqa: E402
from cudasnap._native import native  # noqa: E402
from cudasnap.config import Settings  # noqa: E402
from cudasnap.storage import counters, open_storage, progress  # noqa: E402
from cudasnap.storage.fsspec import FsspecStorage  # noqa: E402

tqdm = pytest.importorskip("tqdm")

# The local S3 server and bucket fixtures of tests/storage/test_s3.py, reused (same names).
s3_server = test_s3.s3_server
s3 = test_s3.s3
small_job = test_s3.small_job


def _flushed(url):
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=url, backend="cpu", flush_on_close=False)
    train(model, opt, snap, 2)
    return snap


def test_s3_flush_and_restore_advance_bytes_written_and_read(s3):
    snap = _flushed(s3)
    try:
        arena = snap.staged_arenas()[0]
        nbytes = int(arena.slot_info(arena.newest_complete())["data_bytes"])
        assert nbytes > 0
        w0, r0 = progress.bytes_written(), progress.bytes_read()
        native_w0 = native().io_bytes()[0]
        snap.flush()
        assert native().io_bytes()[0] == native_w0  # the C++ flusher did not move them
        assert (progress.bytes_written() - w0, progress.bytes_read() - r0) == (nbytes, 0)
    finally:
        snap.close()
    model2, opt2 = small_job(seed=1)
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=s3, backend="cpu", flush_on_close=False)
    try:
        w1, r1 = progress.bytes_written(), progress.bytes_read()
        assert snap2.restore_latest() == 2
        assert snap2.stats()["restore"]["source"] == "disk"  # from the object store
        assert (progress.bytes_written() - w1, progress.bytes_read() - r1) == (0, nbytes)
    finally:
        snap2.close()


@pytest.fixture
def tty(monkeypatch):
    monkeypatch.setattr(progress, "enabled", lambda total, min_bytes=0: True)
    monkeypatch.setattr(progress, "POLL_S", 0.01)


def test_progress_bars_of_an_upload_and_a_download_reach_the_data_size(s3, tty):
    snap = _flushed(s3)
    try:
        st = open_storage(s3, Settings.from_env())
        assert isinstance(st, FsspecStorage)
        arena = snap.staged_arenas()[0]
        slot = arena.newest_complete()
        nbytes = int(arena.slot_info(slot)["data_bytes"])
        arena.lease(slot)
        try:
            with progress.io_progress(nbytes, "flush", progress.bytes_written) as bar:
                st.write_slot(arena, slot)
        finally:
            arena.release(slot)
        assert bar.n == nbytes
        ref = st.list_snapshots()[0]
        m = st.load_manifest(ref)
        with progress.io_progress(nbytes, "restore", "read") as bar:
            data = st.read_data(ref, m)
        assert bar.n == nbytes
        assert torch.equal(data, torch.frombuffer(bytearray(arena.data_view(slot, nbytes)),
                                                  dtype=torch.uint8))
    finally:
        snap.close()


def test_python_counters_are_thread_safe_and_ignore_non_positive_counts():
    w0, r0 = counters.io_bytes()

    def work():
        for _ in range(2000):
            counters.add_written(3)
            counters.add_read(1)
            counters.add_read(0)
            counters.add_written(-5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.io_bytes() == (w0 + 4 * 2000 * 3, r0 + 4 * 2000)
