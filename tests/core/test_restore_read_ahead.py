"""data.bin's head read ahead while the restore parses the manifest (issue 26).

* ``_C.FileReadAhead`` reads [0, min(size, limit)) of a file on its own thread, from a
  descriptor of its own; it is best effort (a failing read stops it and says why);
* ``RestorePlan.run_file(ahead=)`` takes the units the read-ahead holds instead of reading
  them, checks each chunk of them against the CRC32C table like one it read (a stale or
  damaged head is CorruptSnapshot, none of that chunk copied), and ignores a read-ahead of
  another file;
* through a Snapshotter the restore from disk starts it before the manifest is loaded,
  takes bytes from it, ends bitwise equal to the restore without it, and stops it however
  the restore ends (also on a snapshot that fails and falls back to an older one).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import parts
from helpers.restore_files import CH, data_file, entry, restore_fresh, same_state, snapshot_to_disk

from cudasnap import storage
from cudasnap.core import file_copy
from cudasnap.errors import CorruptSnapshot
from cudasnap.format import paths
from cudasnap.storage import posix


@pytest.fixture
def C(native_C):
    return native_C


def _held_all(ahead, timeout_s: float = 60.0) -> int:
    """Waits until the read-ahead has read all it set out to (a loaded machine may be slow)."""
    deadline = time.monotonic() + timeout_s
    while ahead.held < ahead.target:
        assert time.monotonic() < deadline, f"read-ahead held {ahead.held} of {ahead.target}"
        time.sleep(0.005)
    return ahead.finish()


def _plan(C, nbytes: int) -> tuple[object, torch.Tensor, torch.Tensor]:
    """A restore plan copying the whole file into one float32 tensor (+ its stand-in buffer)."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.full((nbytes // 4,), 7.0)
    plan = C.plan_pairs([dst], [entry([nbytes // 4], "float32", 0)], *parts.copy_back_kinds(),
                         torch.Tensor, data.data_ptr(), nbytes)
    return plan, dst, data


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("limit", [1, 5 * CH + 3, 1 << 30])
def test_the_read_ahead_holds_the_files_head(C, tmp_path, limit):
    nbytes = 40 * CH + 4
    path, _, _ = data_file(C, tmp_path, nbytes)
    fd = os.open(path, os.O_RDONLY)
    ahead = C.FileReadAhead(fd, limit, 4096)
    os.close(fd)  # it reads through its own descriptor
    assert ahead.target == min(nbytes, limit)
    assert _held_all(ahead) == ahead.target == ahead.held
    assert ahead.error == ""
    assert ahead.finish() == ahead.target  # idempotent
    ahead.release()  # the buffer freed: nothing held any more
    assert (ahead.held, ahead.finish()) == (0, 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_run_file_takes_the_head_from_the_read_ahead(C, tmp_path, threads):
    nbytes = 40 * CH + 4
    path, src, crcs = data_file(C, tmp_path, nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead = C.FileReadAhead(fd, 10 * CH + 100)  # not on a chunk boundary
        _held_all(ahead)
        plan, dst, _ = _plan(C, nbytes)
        st = plan.run_file(fd, str(path), nbytes, CH, crcs, [], threads, 0, False, ahead)
    finally:
        os.close(fd)
    assert st["ahead"] == 10 * CH  # the units wholly inside what it held
    assert st["bytes"] == nbytes - 10 * CH  # the rest read here, nothing twice
    assert plan.applied == nbytes // 4 * 4
    assert np.array_equal(_bytes_of(dst), src[:nbytes // 4 * 4])


@pytest.mark.parametrize("bad", [0, 3])
def test_a_stale_head_fails_its_check_and_none_of_it_is_copied(C, tmp_path, bad):
    """The file changes in place (same inode) after the read-ahead read it: the chunk it
    holds no longer matches the table, and is refused as if read damaged."""
    nbytes = 12 * CH
    path, src, _ = data_file(C, tmp_path, nbytes)
    fd = os.open(path, os.O_RDWR)
    try:
        ahead = C.FileReadAhead(fd, nbytes)
        _held_all(ahead)
        new = src.copy()
        new[bad * CH + 17] ^= 0xFF
        os.pwrite(fd, new[bad * CH:(bad + 1) * CH].tobytes(), bad * CH)
        # the table of the new content (the flusher's, writing it elsewhere)
        crcs = C.write_buffer_file(new.ctypes.data, nbytes, CH, str(tmp_path / "n.bin"), 1,
                                   1 << 20, False)["crc32c"]
        plan, dst, _ = _plan(C, nbytes)
        with pytest.raises(CorruptSnapshot, match=f"chunk {bad} "):
            plan.run_file(fd, str(path), nbytes, CH, crcs, [], 1, 0, False, ahead)
    finally:
        os.close(fd)
    assert plan.applied == bad * CH  # one thread: the chunks before it only
    assert bool((dst[bad * CH // 4:] == 7.0).all())


def test_a_read_ahead_of_another_file_is_not_used(C, tmp_path):
    nbytes = 9 * CH
    path_a, _, _ = data_file(C, tmp_path, nbytes, seed=1)
    path_b, src_b, crcs_b = data_file(C, tmp_path, nbytes, seed=2)
    fa = os.open(path_a, os.O_RDONLY)
    ahead = C.FileReadAhead(fa, nbytes)
    os.close(fa)
    _held_all(ahead)
    fb = os.open(path_b, os.O_RDONLY)
    try:
        plan, dst, _ = _plan(C, nbytes)
        st = plan.run_file(fb, str(path_b), nbytes, CH, crcs_b, [], 2, 0, False, ahead)
    finally:
        os.close(fb)
    assert st["ahead"] == 0 and st["bytes"] == nbytes
    assert np.array_equal(_bytes_of(dst), src_b)


def test_the_read_ahead_is_best_effort(C, tmp_path):
    nbytes = 6 * CH
    path, src, crcs = data_file(C, tmp_path, nbytes)
    fw = os.open(path, os.O_WRONLY)  # its reads fail (EBADF): it stops and says why
    try:
        failed = C.FileReadAhead(fw, nbytes)
    finally:
        os.close(fw)
    assert failed.target == nbytes
    deadline = time.monotonic() + 60
    while not failed.error:  # its first read fails (a finish() before it would stop it first)
        assert time.monotonic() < deadline, "the failed read was not reported"
        time.sleep(0.005)
    assert "pread at offset 0" in failed.error and failed.finish() == 0
    r, w = os.pipe()  # not a regular file: nothing to read
    try:
        piped = C.FileReadAhead(r, nbytes)
        assert (piped.target, piped.finish(), piped.error) == (0, 0, "")
    finally:
        os.close(r)
        os.close(w)
    fd = os.open(path, os.O_RDONLY)
    try:
        off = C.FileReadAhead(fd, 0)
        assert (off.target, off.finish()) == (0, 0)
        plan, dst, _ = _plan(C, nbytes)  # a failed read-ahead: the scatter reads it all
        st = plan.run_file(fd, str(path), nbytes, CH, crcs, [], 2, 0, False, failed)
    finally:
        os.close(fd)
    assert st["ahead"] == 0
    assert np.array_equal(_bytes_of(dst), src)


def test_posix_read_ahead_only_for_a_regular_data_file_of_this_users(C, tmp_path, monkeypatch):
    d = tmp_path / "step"
    d.mkdir()
    assert posix.read_ahead(d) is None  # no data.bin
    (tmp_path / "elsewhere.bin").write_bytes(b"x" * 10)
    os.symlink(tmp_path / "elsewhere.bin", d / paths.DATA)
    assert posix.read_ahead(d) is None  # a symlink is never followed
    os.unlink(d / paths.DATA)
    (d / paths.DATA).write_bytes(b"y" * 5000)
    a = posix.read_ahead(d)
    assert a is not None and a.target == 5000
    a.finish()
    monkeypatch.setattr(posix, "READ_AHEAD_BYTES", 0)
    assert posix.read_ahead(d) is None  # off
    monkeypatch.setattr(posix, "READ_AHEAD_BYTES", 1 << 20)
    parts.replace_check_trust(monkeypatch, _refuse)
    assert posix.read_ahead(d) is None  # another user's file: the DataFile will say so


def _refuse(path, st, allow_foreign_owner):
    raise CorruptSnapshot(f"{path} is owned by another user")


def test_a_restore_from_disk_reads_ahead_and_ends_bitwise_equal(snap_env, monkeypatch):
    want, _ = snapshot_to_disk(snap_env, 400)
    scattered: list[dict] = []
    files: list[posix.DataFile] = []
    real_scatter, real_open = file_copy.run_plan, storage.PosixStorage.open_data

    def scatter(src, plan, extra):
        handed = src.ahead is not None  # by restore_dir (unless READ_AHEAD_BYTES is 0)
        if handed:  # a loaded machine may not have scheduled the reader yet: let it read
            _held_all(src.ahead)
        st = real_scatter(src, plan, extra)
        assert src.ahead is None  # stopped and let go once the scatter is done
        scattered.append({"handed": handed, **st})
        return st

    def open_data(*a, **kw):
        files.append(real_open(*a, **kw))
        return files[-1]

    monkeypatch.setattr(file_copy, "run_plan", scatter)
    monkeypatch.setattr(storage.PosixStorage, "open_data", open_data)
    got, step, _ = restore_fresh(snap_env, 400, "ahead")
    assert step == 1 and len(scattered) == 1 and scattered[0]["handed"]
    assert scattered[0]["ahead"] > 0, "the restore took nothing from the read-ahead"
    assert scattered[0]["ahead"] + scattered[0]["bytes"] == files[0].nbytes  # each byte once
    monkeypatch.setattr(posix, "READ_AHEAD_BYTES", 0)
    plain, step2, _ = restore_fresh(snap_env, 400, "no-ahead")
    assert step2 == 1 and not scattered[1]["handed"] and scattered[1]["ahead"] == 0
    same_state(got, want)
    same_state(got, plain)


class _Spy:
    """Stands for a read-ahead that must be stopped (never reaches the engine)."""

    def __init__(self, real) -> None:
        self.real, self.finished = real, 0

    def finish(self) -> int:
        self.finished += 1
        return self.real.finish()

    def release(self) -> None:
        self.finished += 1
        self.real.release()


def test_the_read_ahead_is_stopped_when_its_snapshot_fails(snap_env, monkeypatch):
    """The newest snapshot's manifest is damaged: the restore falls back to the older one,
    and the newer one's read-ahead is stopped on the way."""
    want, dirs = snapshot_to_disk(snap_env, 0, steps=2)
    mpath = dirs[1] / paths.MANIFEST
    raw = bytearray(mpath.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    mpath.write_bytes(bytes(raw))
    spies: list[_Spy] = []
    real = storage.PosixStorage.read_ahead

    def read_ahead(store, ref, allow_foreign_owner=None):
        a = real(store, ref, allow_foreign_owner)
        if Path(ref.path) == dirs[1] and a is not None:
            spies.append(_Spy(a))
            return spies[-1]
        return a

    monkeypatch.setattr(storage.PosixStorage, "read_ahead", read_ahead)
    _, step, _ = restore_fresh(snap_env, 0, "fallback")
    assert step == 1  # the older snapshot (step 0), resumed at 1
    assert len(spies) == 1 and spies[0].finished >= 1


def test_the_whole_file_read_takes_the_head_from_the_read_ahead(C, snap_env, monkeypatch):
    """``file_copy.read_whole`` (a destination torch must copy to: CUDA, sharded) reads the open,
    checked file chunk by chunk into one new buffer, the head from the read-ahead."""
    _, dirs = snapshot_to_disk(snap_env, 400)
    d = dirs[-1]
    manifest = posix.load_manifest(d / paths.MANIFEST)
    seen: list[dict] = []
    real = C.read_file_scatter

    def spy(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(C, "read_file_scatter", spy)
    ahead = posix.read_ahead(d)
    assert ahead is not None
    _held_all(ahead)
    f = posix.DataFile(d, manifest, ahead=ahead)
    try:
        got = file_copy.read_whole(f)
        assert f.ahead is None and ahead.held == 0  # stopped and freed
    finally:
        f.close()
    want = np.fromfile(d / paths.DATA, dtype=np.uint8)
    assert np.array_equal(got.numpy(), want)
    assert len(want) <= posix.READ_AHEAD_BYTES  # a small file: all of it read ahead
    assert len(seen) == 1 and (seen[0]["ahead"], seen[0]["bytes"]) == (len(want), 0)
