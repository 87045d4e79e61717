"""CRC32C (csrc/crc32c.*), the flusher (csrc/flusher.*) and the on-disk store protocol."""
from __future__ import annotations

import ctypes
import json
import os
import random

import numpy as np
import pytest

from cudasnap.errors import CorruptSnapshot, FlushError, SnapshotError, StagingError
from cudasnap.format import manifest as M
from cudasnap.format import paths
from cudasnap.storage import latest, posix
from tools.faults import layout as L


@pytest.fixture
def C(native_C):
    return native_C


# ------------------------------------------------------------------ crc32c

def test_crc32c_known_vectors(C):
    assert C.crc32c(b"123456789") == 0xE3069283
    assert C.crc32c(b"") == 0
    # RFC 3720 (iSCSI) B.4 test vectors
    assert C.crc32c(bytes(32)) == 0x8A9136AA
    assert C.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert C.crc32c(bytes(range(32))) == 0x46DD794E
    assert C.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert L.crc32c_ref(b"123456789") == 0xE3069283  # the test's own reference agrees


def test_crc32c_matches_reference_and_continues_across_chunks(C):
    rnd = random.Random(5)
    for n in list(range(0, 40)) + [63, 64, 65, 1000, 4097]:
        data = bytes(rnd.getrandbits(8) for _ in range(n))
        want = L.crc32c_ref(data)
        assert C.crc32c(data) == want, n
        # unaligned starts (the 8-byte loop must not assume alignment)
        for shift in range(1, 8):
            buf = bytearray(b"\x00" * shift + data)
            assert C.crc32c(memoryview(buf)[shift:]) == want
        for cut in {0, n // 3, n // 2, n}:
            assert C.crc32c(data[cut:], C.crc32c(data[:cut])) == want
    # many pieces, as a chunked writer continues it
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    crc = 0
    pos = 0
    while pos < len(data):
        step = rnd.randint(1, 70000)
        crc = C.crc32c(data[pos:pos + step], crc)
        pos += step
    assert crc == C.crc32c(data)
    arr = np.frombuffer(data, np.uint8)
    assert C.crc32c_ptr(arr.ctypes.data + 3, 5000) == L.crc32c_ref(data[3:5003])


# ----------------------------------------------------------------- flusher

def _chunk_crcs(data: bytes, chunk: int) -> list[int]:
    return [L.crc32c_ref(data[i:i + chunk]) for i in range(0, len(data), chunk)]


@pytest.mark.parametrize("nbytes,chunk,threads,io", [
    (0, 4096, 2, 4096), (1, 4096, 1, 4096), (4096 * 5, 4096, 3, 8192),
    (4096 * 7 + 13, 4096, 4, 3 * 4096), (300_000, 8192, 2, 1 << 20)])
def test_write_then_read_back_verified(C, snap_env, nbytes, chunk, threads, io):
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, max(nbytes, 1), dtype=np.uint8)[:nbytes]
    path = snap_env.tmp / "data.bin"
    st = C.write_buffer_file(src.ctypes.data, nbytes, chunk, str(path), threads, io, True)
    assert st["bytes"] == nbytes
    assert st["crc32c"] == _chunk_crcs(src.tobytes(), chunk)
    assert path.read_bytes() == src.tobytes()
    assert os.stat(path).st_mode & 0o777 == 0o600
    dst = np.full(max(nbytes, 1), 0xAB, np.uint8)
    C.read_file_verified(str(path), dst.ctypes.data, nbytes, chunk, st["crc32c"], threads)
    assert np.array_equal(dst[:nbytes], src)
    with pytest.raises(FlushError, match="create"):  # never overwrites
        C.write_buffer_file(src.ctypes.data, nbytes, chunk, str(path), threads, io, True)


def test_flipped_byte_names_file_and_chunk(C, snap_env):
    chunk = 4096
    src = np.random.default_rng(1).integers(0, 256, 10 * chunk + 500, dtype=np.uint8)
    path = snap_env.tmp / "data.bin"
    crcs = C.write_buffer_file(src.ctypes.data, src.size, chunk, str(path), 2, chunk, False)[
        "crc32c"]
    dst = np.zeros(src.size, np.uint8)
    for bad_chunk in (0, 6, 10):
        off = bad_chunk * chunk + 17 if bad_chunk < 10 else src.size - 1
        L.flip_byte(path, off, 0x40)
        with pytest.raises(CorruptSnapshot) as ei:
            C.read_file_verified(str(path), dst.ctypes.data, src.size, chunk, crcs, 3)
        msg = str(ei.value)
        assert str(path) in msg and f"chunk {bad_chunk} " in msg, msg
        L.flip_byte(path, off, 0x40)
    C.read_file_verified(str(path), dst.ctypes.data, src.size, chunk, crcs, 3)
    # verify_buffer reports the first bad chunk of a buffer
    buf = src.copy()
    buf[5 * chunk] ^= 1
    buf[2 * chunk + 9] ^= 1
    assert C.verify_buffer(buf.ctypes.data, buf.size, chunk, crcs, 4) == 2
    assert C.verify_buffer(src.ctypes.data, src.size, chunk, crcs, 4) == -1
    with pytest.raises(CorruptSnapshot, match="entries"):
        C.verify_buffer(src.ctypes.data, src.size, chunk, crcs[:-1], 4)


def test_truncated_or_extended_file_is_corrupt(C, snap_env):
    chunk = 4096
    src = np.random.default_rng(2).integers(0, 256, 3 * chunk, dtype=np.uint8)
    path = snap_env.tmp / "data.bin"
    crcs = C.write_buffer_file(src.ctypes.data, src.size, chunk, str(path), 1, chunk, False)[
        "crc32c"]
    dst = np.zeros(src.size, np.uint8)
    os.truncate(path, src.size - 1)
    with pytest.raises(CorruptSnapshot, match="truncated") as ei:
        C.read_file_verified(str(path), dst.ctypes.data, src.size, chunk, crcs, 2)
    assert str(path) in str(ei.value)
    with open(path, "ab") as f:
        f.write(b"xx")
    with pytest.raises(CorruptSnapshot, match="truncated or replaced"):
        C.read_file_verified(str(path), dst.ctypes.data, src.size, chunk, crcs, 2)
    with pytest.raises(CorruptSnapshot, match="chunk checksums"):
        C.read_file_verified(str(path), dst.ctypes.data, src.size, chunk, crcs + [1], 2)
    with pytest.raises(FlushError, match="open"):
        C.read_file_verified(str(snap_env.tmp / "nope"), dst.ctypes.data, 1, chunk, [0], 1)


def _committed_slot(C, env, data: bytes, step=3, chunk=4096, meta=None):
    arena = C.Arena.create(str(env.scratch_arena("fl")), 2, max(len(data), 1) + chunk, 65536,
                           chunk, env.job, True)
    meta = meta or json.dumps({"tensors": [], "host": {}, "step": step}).encode()
    arena.begin_write(0, step, meta)
    if data:
        np.frombuffer(arena.data_view(0, len(data)), np.uint8)[:] = np.frombuffer(data, np.uint8)
    n = -(-len(data) // chunk)
    table = (ctypes.c_uint32 * max(n, 1)).from_address(arena.table_ptr(0))
    for i in range(n):
        table[i] = C.crc32c(data[i * chunk:(i + 1) * chunk])
    arena.commit(0, step, len(data))
    return arena


def test_write_slot_file_checks_lease_state_and_staged_crcs(C, snap_env):
    data = np.random.default_rng(3).integers(0, 256, 5 * 4096 + 7, dtype=np.uint8).tobytes()
    arena = _committed_slot(C, snap_env, data)
    out = snap_env.tmp / "slot.bin"
    with pytest.raises(StagingError, match="without a lease"):
        C.write_slot_file(arena, 0, str(out))
    arena.lease(0)
    st = C.write_slot_file(arena, 0, str(out), 2, 8192, True)
    assert out.read_bytes() == data and st["crc32c"] == arena.read_table(0)
    arena.lease(1)
    with pytest.raises(CorruptSnapshot, match="not complete"):
        C.write_slot_file(arena, 1, str(snap_env.tmp / "empty.bin"))
    # Shared memory is not trusted blindly: a byte flipped after commit is caught
    # before it reaches disk, and no partial file is left behind.
    L.flip_byte(snap_env.scratch_arena("fl"), L.data_offset(0, arena.data_capacity, 65536, 4096)
                + 3 * 4096 + 1)
    bad = snap_env.tmp / "bad.bin"
    with pytest.raises(CorruptSnapshot, match=r"chunk 3 .*fails its CRC32C before flush"):
        C.write_slot_file(arena, 0, str(bad), 2, 4096, True)
    assert not bad.exists()
    arena.release(0)
    arena.release(1)


# -------------------------------------------------------------------- store

def _tensor_meta(data_len):
    return {"tensors": [{"name": "model.w", "group": "model:model", "dtype": "uint8",
                         "shape": [data_len], "stride": [1], "storage_offset": 0, "offset": 0,
                         "nbytes": data_len, "phase": 1}],
            "host": {"step": 3}, "step": 3, "format": "cudasnap", "format_version": 1}


def test_store_commit_protocol_round_trip(C, snap_env):
    data = np.random.default_rng(4).integers(0, 256, 3 * 4096 + 5, dtype=np.uint8).tobytes()
    arena = _committed_slot(C, snap_env, data, meta=json.dumps(_tensor_meta(len(data))).encode())
    d = posix.check_directory(snap_env.dir)
    assert oct(d.stat().st_mode & 0o777) == oct(0o700)
    arena.lease(0)
    try:
        path, st = posix.write_slot(arena, 0, d, threads=2)
        assert path == d / "step-00000003" and st["bytes"] == len(data)
        again, st2 = posix.write_slot(arena, 0, d)  # already durable: skipped
        assert again == path and st2.get("skipped")
    finally:
        arena.release(0)
    assert latest.read_latest(d) == "step-00000003"
    assert sorted(p.name for p in path.iterdir()) == ["data.bin", "manifest.json"]
    assert not list(d.glob("*.tmp*"))
    m = posix.load_manifest(path / "manifest.json")
    assert m["step"] == 3 and m["data"]["crc32c"] == arena.read_table(0)
    buf = posix.read_data(path, m)
    assert buf.numpy().tobytes() == data
    assert [s.step for s in posix.list_snapshots(d)] == [3]


def test_store_prune_keeps_newest_and_latest(snap_env):
    d = posix.check_directory(snap_env.dir)
    for step in (1, 5, 9, 12, 20):
        (d / paths.step_dirname(step)).mkdir()
    tmp = d / f"step-00000030.tmp-{os.getpid()}"  # this process's, from an earlier life
    tmp.mkdir()
    (d / "latest").write_text("step-00000005\n")
    posix.prune(d, 2)
    assert [s.step for s in posix.list_snapshots(d)] == [20, 12, 5]  # latest is kept too
    assert posix.clean_partial(d) == [tmp]
    assert not tmp.exists()


def test_store_load_manifest_rejects_garbage(snap_env):
    d = posix.check_directory(snap_env.dir)
    p = d / "manifest.json"
    p.write_bytes(b"{not json")
    with pytest.raises(CorruptSnapshot, match="not valid JSON"):
        posix.load_manifest(p)
    p.write_text(json.dumps({"format": "cudasnap", "format_version": 1, "step": 1}))
    with pytest.raises(CorruptSnapshot, match="missing 'data'"):
        posix.load_manifest(p)
    with pytest.raises(CorruptSnapshot, match="cannot read"):
        posix.load_manifest(d / "missing.json")


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_check_directory_refuses_unwritable_places(tmp_path, where):
    if where == "under-a-file":
        f = tmp_path / "plain-file"
        f.write_text("x")
        target = f / "ckpt"
    else:
        target = "/proc/cudasnap-test/ckpt"
    with pytest.raises(SnapshotError, match="not writable"):
        posix.check_directory(target)


def test_read_data_of_a_snapshot_missing_its_data_file_is_corrupt(C, snap_env):
    """A half-pruned (or hand-damaged) snapshot must make restore fall back, not fail."""
    data = b"\x01" * 5000
    arena = _committed_slot(C, snap_env, data, meta=json.dumps(_tensor_meta(len(data))).encode())
    d = posix.check_directory(snap_env.dir)
    arena.lease(0)
    path, _ = posix.write_slot(arena, 0, d, threads=1)
    arena.release(0)
    m = posix.load_manifest(path / "manifest.json")
    (path / "data.bin").unlink()
    with pytest.raises(CorruptSnapshot, match="missing"):
        posix.read_data(path, m)


def test_manifest_checksum_catches_a_flipped_digit(C, snap_env):
    """Data chunks have CRCs; the manifest (offsets, lr, RNG states) must be covered too."""
    data = b"\x02" * 5000
    meta = _tensor_meta(len(data))
    meta["host"] = {"step": 3, "optim": {"lr": 0.005}}
    arena = _committed_slot(C, snap_env, data, meta=json.dumps(meta).encode())
    d = posix.check_directory(snap_env.dir)
    arena.lease(0)
    path, _ = posix.write_slot(arena, 0, d, threads=1)
    arena.release(0)
    man = path / "manifest.json"
    m = posix.load_manifest(man)
    assert m["host"]["optim"]["lr"] == 0.005 and M.MANIFEST_CRC in m
    raw = man.read_bytes()
    pos = raw.index(b"0.005") + 4
    L.flip_byte(man, pos, 0x01)  # 0.005 -> 0.004: still valid JSON, still a sane manifest
    assert json.loads(man.read_bytes())["host"]["optim"]["lr"] == 0.004
    with pytest.raises(CorruptSnapshot, match="manifest checksum mismatch"):
        posix.load_manifest(man)


def test_flush_active_counts_running_flushes(C, snap_env):
    """flush_active() (polled by copy engines to yield to a flush) is > 0 exactly while
    a write runs, and drops back after a success and after a failure."""
    import threading

    assert C.flush_active() == 0
    started = C.flushes_started()
    src = np.ones(64 << 20, np.uint8)
    seen = False
    for attempt in range(5):  # a 64 MiB write + CRC takes tens of ms; polling sees it
        path = snap_env.tmp / f"active-{attempt}.bin"
        th = threading.Thread(target=C.write_buffer_file,
                              args=(src.ctypes.data, src.size, 1 << 20, str(path), 1, 1 << 20,
                                    True))
        th.start()
        while th.is_alive() and not seen:
            seen = C.flush_active() > 0
        th.join()
        assert C.flush_active() == 0
        if seen:
            break
    assert seen, "flush_active() never reported the running flush"
    assert C.flushes_started() == started + attempt + 1
    with pytest.raises(FlushError, match="create"):  # the file exists: fails at open
        C.write_buffer_file(src.ctypes.data, 4096, 4096, str(path), 1, 4096, True)
    assert C.flush_active() == 0
    assert C.flushes_started() == started + attempt + 2


def test_durable_flush_file_is_fully_allocated(C, snap_env):
    """The space is reserved and written (no holes): a full disk fails before the data."""
    src = np.random.default_rng(4).integers(0, 256, (3 << 20) + 4097, dtype=np.uint8)
    path = snap_env.tmp / "alloc.bin"
    C.write_buffer_file(src.ctypes.data, src.size, 1 << 20, str(path), 2, 1 << 20, True)
    st = os.stat(path)
    assert st.st_size == src.size
    assert st.st_blocks * 512 >= src.size
    assert path.read_bytes() == src.tobytes()
