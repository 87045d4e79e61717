"""Staging arena (csrc/staging.*): geometry, file mode, free-space check, slot protocol."""
from __future__ import annotations

import ctypes
import os
import re
import struct

import numpy as np
import pytest

from cudasnap.errors import CorruptSnapshot, IncompatibleSnapshot, StagingError
from tools.faults import layout as L

CAP = 3 * 4096 + 100  # data capacity: not a multiple of the chunk size on purpose
META = 5000
CHUNK = 4096


@pytest.fixture
def C(native_C):
    return native_C


def make(C, env, name="a", slots=2, cap=CAP, meta=META, chunk=CHUNK, prefault=True):
    return C.Arena.create(str(env.scratch_arena(name)), slots, cap, meta, chunk, env.job, prefault)


def fill_slot(C, arena, slot, step, nbytes, rng, meta=None):
    """Writes a snapshot the way an engine does: begin_write, data, CRC table, commit."""
    meta = meta if meta is not None else f'{{"step":{step}}}'.encode()
    arena.begin_write(slot, step, meta)
    payload = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if nbytes:
        np.frombuffer(arena.data_view(slot, nbytes), dtype=np.uint8)[:] = payload
    nchunks = (nbytes + arena.chunk_bytes - 1) // arena.chunk_bytes
    table = (ctypes.c_uint32 * max(nchunks, 1)).from_address(arena.table_ptr(slot))
    for c in range(nchunks):
        table[c] = L.crc32c_ref(payload[c * arena.chunk_bytes:(c + 1) * arena.chunk_bytes]
                                .tobytes())
    arena.commit(slot, step, nbytes)
    return payload


# ------------------------------------------------------------------ geometry

def test_geometry_matches_layout_model(C, snap_env):
    for slots, cap, meta, chunk in [(2, CAP, META, CHUNK), (3, 1 << 20, 4096, 1 << 16),
                                    (8, 1, 1, 4096), (2, 10 * 4096, 0, 8192)]:
        want = L.required_bytes(slots, cap, meta, chunk)
        assert C.Arena.required_bytes(slots, cap, meta, chunk) == want
    a = make(C, snap_env)
    path = snap_env.scratch_arena("a")
    assert a.total_bytes == L.required_bytes(2, CAP, META, CHUNK) == os.path.getsize(path)
    assert (a.num_slots, a.data_capacity, a.meta_capacity, a.chunk_bytes) == (2, CAP, META, CHUNK)
    assert a.max_chunks == L.max_chunks(CAP, CHUNK) == 4
    assert a.job == snap_env.job and a.owner_pid == os.getpid() and a.writable
    raw = path.read_bytes()
    assert L.u64(raw, L.AH_STRIDE) == L.slot_stride(CAP, META, CHUNK)
    assert L.u64(raw, L.AH_TOTAL) == a.total_bytes
    for s in range(2):
        off = L.slot_offset(s, CAP, META, CHUNK)
        assert L.u32(raw, off + L.SH_STATE) == L.EMPTY and L.i64(raw, off + L.SH_STEP) == -1
        assert a.data_ptr(s) - a.data_ptr(0) == s * L.slot_stride(CAP, META, CHUNK)
        assert a.table_ptr(s) + (L.data_offset(s, CAP, META, CHUNK)
                                 - L.table_offset(s, CAP, META, CHUNK)) == a.data_ptr(s)
        info = a.slot_info(s)
        assert info["state"] == "EMPTY" and not info["valid"] and info["step"] == -1
    assert a.newest_complete() == -1
    b = C.Arena.open(str(path), False)
    assert (b.num_slots, b.data_capacity, b.meta_capacity, b.chunk_bytes, b.total_bytes) == \
        (2, CAP, META, CHUNK, a.total_bytes)
    assert not b.writable and b.job == snap_env.job


def test_file_mode_is_0600_whatever_the_umask(C, snap_env):
    old = os.umask(0)
    try:
        make(C, snap_env)
    finally:
        os.umask(old)
    st = os.stat(snap_env.scratch_arena("a"))
    assert st.st_mode & 0o777 == 0o600


def test_create_refuses_existing_file_and_bad_arguments(C, snap_env):
    make(C, snap_env)
    before = snap_env.scratch_arena("a").read_bytes()
    with pytest.raises(StagingError, match="cannot create staging arena"):
        make(C, snap_env)
    assert snap_env.scratch_arena("a").read_bytes() == before  # the existing arena is untouched
    for kw, msg in [(dict(slots=1), "slots"), (dict(slots=9), "slots"),
                    (dict(chunk=1000), "multiple of 4096"), (dict(chunk=0), "multiple of 4096"),
                    (dict(cap=0), "capacity")]:
        with pytest.raises(StagingError, match=msg):
            make(C, snap_env, name="bad", **kw)
        assert not snap_env.scratch_arena("bad").exists()


def test_free_space_refusal_names_the_sizes(C, snap_env):
    vfs = os.statvfs(snap_env.shm)
    avail = vfs.f_bavail * vfs.f_frsize
    cap = avail + (3 << 30)  # 3 GiB more than the tmpfs has free
    total = C.Arena.required_bytes(2, cap, META, CHUNK)
    path = snap_env.scratch_arena("huge")
    with pytest.raises(StagingError) as ei:
        C.Arena.create(str(path), 2, cap, META, CHUNK, snap_env.job, True)
    msg = str(ei.value)
    assert str(path) in msg
    assert f"needs {total / 2**30:.2f} GiB" in msg
    assert f"2 slots of {cap / 2**30:.2f} GiB" in msg
    m = re.search(r"has only ([0-9.]+) GiB free of ([0-9.]+) GiB", msg)
    assert m, msg
    # Other processes use /dev/shm too: the free figure may move a little.
    assert abs(float(m.group(1)) - avail / 2**30) < 0.5
    assert abs(float(m.group(2)) - vfs.f_blocks * vfs.f_frsize / 2**30) < 0.01
    assert not path.exists()  # refused before anything was created


# --------------------------------------------------------------------- open

def test_open_rejects_missing_truncated_and_foreign_files(C, snap_env):
    missing = snap_env.scratch_arena("missing")
    with pytest.raises(StagingError, match="cannot open"):
        C.Arena.open(str(missing), True)
    small = snap_env.scratch_arena("small")
    small.write_bytes(b"\0" * 100)
    with pytest.raises(CorruptSnapshot, match="truncated"):
        C.Arena.open(str(small), True)
    foreign = snap_env.scratch_arena("foreign")
    foreign.write_bytes(os.urandom(8192))
    with pytest.raises(CorruptSnapshot, match="bad magic"):
        C.Arena.open(str(foreign), True)


def _rewrite_arena_header(path, **fields):
    """Changes ArenaHeader fields and recomputes its CRC (a 'consistent' lie)."""
    raw = bytearray(path.read_bytes()[:L.AH_SIZE])
    offs = {"version": (L.AH_VERSION, "<I"), "num_slots": (L.AH_NUM_SLOTS, "<I"),
            "data_capacity": (L.AH_DATA_CAP, "<Q"), "total_bytes": (L.AH_TOTAL, "<Q"),
            "max_chunks": (L.AH_MAX_CHUNKS, "<Q")}
    for k, v in fields.items():
        off, fmt = offs[k]
        struct.pack_into(fmt, raw, off, v)
    struct.pack_into("<I", raw, L.AH_CRC, 0)
    struct.pack_into("<I", raw, L.AH_CRC, L.crc32c_ref(bytes(raw)))
    with open(path, "r+b") as f:
        f.write(raw)


def test_open_checks_header_crc_version_and_geometry(C, snap_env):
    path = snap_env.scratch_arena("a")
    make(C, snap_env)
    C.Arena.open(str(path), True)  # sound
    L.flip_byte(path, L.AH_DATA_CAP)
    with pytest.raises(CorruptSnapshot, match="header checksum mismatch"):
        C.Arena.open(str(path), True)
    L.flip_byte(path, L.AH_DATA_CAP)  # undo
    C.Arena.open(str(path), True)

    _rewrite_arena_header(path, version=7)
    with pytest.raises(IncompatibleSnapshot, match="format version 7"):
        C.Arena.open(str(path), True)
    _rewrite_arena_header(path, version=1, data_capacity=CAP * 4)  # stride no longer fits
    with pytest.raises(CorruptSnapshot, match="inconsistent geometry"):
        C.Arena.open(str(path), True)
    _rewrite_arena_header(path, data_capacity=CAP)
    C.Arena.open(str(path), True)
    # max_chunks places the meta and data areas: a wrong one would point outside the slot
    _rewrite_arena_header(path, max_chunks=1 << 40)
    with pytest.raises(CorruptSnapshot, match="inconsistent geometry"):
        C.Arena.open(str(path), True)
    _rewrite_arena_header(path, max_chunks=L.max_chunks(CAP, CHUNK))
    C.Arena.open(str(path), True)
    # A file cut short (e.g. a tmpfs that filled up): geometry says more than the file holds.
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(CorruptSnapshot, match="inconsistent geometry"):
        C.Arena.open(str(path), True)


# ------------------------------------------------------------ slot protocol

def test_writing_slot_is_invisible_until_commit(C, snap_env):
    rng = np.random.default_rng(1)
    a = make(C, snap_env)
    reader = C.Arena.open(str(snap_env.scratch_arena("a")), False)  # another "process"
    payload = fill_slot(C, a, 0, 10, CAP, rng)
    assert a.newest_complete() == 0 and reader.newest_complete() == 0

    a.begin_write(1, 11, b'{"step":11}')
    for arena in (a, reader):
        info = arena.slot_info(1)
        assert info["state"] == "WRITING" and not info["valid"] and info["step"] == 11
        assert arena.newest_complete() == 0  # the half-written step 11 is invisible
    np.frombuffer(a.data_view(1, 100), dtype=np.uint8)[:] = 7
    assert reader.newest_complete() == 0
    with pytest.raises(CorruptSnapshot, match="not a complete snapshot"):
        reader.read_meta(1)
    a.commit(1, 11, 100)
    # commit() does not compute chunk CRCs itself: the table it publishes is what we wrote (0).
    info = reader.slot_info(1)
    assert info["state"] == "COMPLETE" and info["valid"] and info["problem"] == ""
    assert (info["step"], info["data_bytes"], info["num_chunks"]) == (11, 100, 1)
    assert info["writer_pid"] == os.getpid() and info["seq"] > a.slot_info(0)["seq"]
    assert reader.newest_complete() == 1
    assert reader.read_meta(1) == b'{"step":11}'
    # Slot 0 still holds step 10, byte for byte.
    assert bytes(reader.data_view(0, CAP)) == payload.tobytes()
    assert reader.read_table(0) == [L.crc32c_ref(payload[i:i + CHUNK].tobytes())
                                    for i in range(0, CAP, CHUNK)]


def test_torn_write_seen_by_a_new_process_view(C, snap_env):
    rng = np.random.default_rng(2)
    a = make(C, snap_env)
    fill_slot(C, a, 0, 3, 5000, rng)
    fill_slot(C, a, 1, 4, 6000, rng)
    a.begin_write(0, 5, b"{}")  # the writer "dies" here
    del a
    b = C.Arena.open(str(snap_env.scratch_arena("a")), True)
    assert b.slot_info(0)["state"] == "WRITING"
    assert b.newest_complete() == 1 and b.slot_info(1)["step"] == 4
    assert b.pick_write_slot() == 0  # the torn slot is reused, the COMPLETE one kept
    # The next writer continues the sequence numbers of the arena it adopted.
    seq_before = max(b.slot_info(i)["seq"] for i in range(2))
    fill_slot(C, b, 0, 5, 10, rng)
    assert b.slot_info(0)["seq"] > seq_before
    assert b.newest_complete() == 0


def test_commit_and_begin_write_checks(C, snap_env):
    a = make(C, snap_env)
    with pytest.raises(StagingError, match="without a matching begin_write"):
        a.commit(0, 1, 10)
    a.begin_write(0, 1, b"x")
    with pytest.raises(StagingError, match="without a matching begin_write"):
        a.commit(0, 2, 10)  # another step
    with pytest.raises(StagingError, match="exceeds slot capacity"):
        a.commit(0, 1, CAP + 1)
    with pytest.raises(StagingError, match="meta area"):
        a.begin_write(1, 1, b"x" * (META + 1))
    with pytest.raises(StagingError, match="out of range"):
        a.begin_write(2, 1, b"x")
    with pytest.raises(StagingError, match="out of range"):
        a.slot_info(-1)
    ro = C.Arena.open(str(snap_env.scratch_arena("a")), False)
    with pytest.raises(StagingError, match="read-only"):
        ro.begin_write(1, 1, b"x")
    a.commit(0, 1, 0)
    assert a.slot_info(0)["valid"] and a.slot_info(0)["num_chunks"] == 0
    a.invalidate(0)
    assert a.slot_info(0)["state"] == "EMPTY" and a.newest_complete() == -1


def test_newest_complete_and_pick_write_slot_with_leases(C, snap_env):
    rng = np.random.default_rng(3)
    a = make(C, snap_env, slots=3)
    assert a.pick_write_slot() in (0, 1, 2)
    fill_slot(C, a, 0, 1, 100, rng)
    fill_slot(C, a, 1, 2, 100, rng)
    assert a.newest_complete() == 1
    assert a.pick_write_slot() == 2  # an EMPTY slot before any COMPLETE one
    a.lease(2)
    assert a.leases(2) == 1
    assert a.pick_write_slot() == 0  # the oldest COMPLETE that is not the newest
    with pytest.raises(StagingError, match="leased"):
        a.begin_write(2, 9, b"{}")
    a.lease(0)
    assert a.pick_write_slot() == -1  # newest kept, the rest leased: nothing to overwrite
    a.release(0)
    a.release(2)
    with pytest.raises(StagingError, match="not leased"):
        a.release(2)
    assert a.leases(2) == 0
    # The newest slot is never handed out for writing, even when leased slots free up.
    fill_slot(C, a, 2, 3, 100, rng)
    assert a.newest_complete() == 2
    for _ in range(4):
        s = a.pick_write_slot()
        assert s != a.newest_complete()
        fill_slot(C, a, s, a.slot_info(a.newest_complete())["step"] + 1, 100, rng)


def test_newest_is_the_most_recently_committed(C, snap_env):
    """A process that restarted training from an older step (an arena left by an
    earlier run, or a restore that fell back to disk) must not keep flushing the
    stale, higher-numbered slot once it has committed its own snapshot."""
    rng = np.random.default_rng(4)
    a = make(C, snap_env)
    fill_slot(C, a, 0, 1000, 100, rng)  # left by a previous run
    s = a.pick_write_slot()
    assert s == 1
    fill_slot(C, a, s, 3, 100, rng)  # the new run's first snapshot
    assert a.newest_complete() == 1
    s = a.pick_write_slot()
    assert s == 0  # so the stale step-1000 slot is overwritten next
    fill_slot(C, a, s, 4, 100, rng)
    assert a.newest_complete() == 0 and a.slot_info(0)["step"] == 4


REGIONS = {
    # name: (offset in the slot relative to fields, expected problem)
    "header step": ("hdr", L.SH_STEP, "slot header checksum mismatch"),
    "header data_bytes": ("hdr", L.SH_DATA_BYTES, "slot header checksum mismatch"),
    "header table_crc": ("hdr", L.SH_TABLE_CRC, "slot header checksum mismatch"),
    "header crc": ("hdr", L.SH_HEADER_CRC, "slot header checksum mismatch"),
    "header magic": ("hdr", L.SH_MAGIC, "bad slot magic"),
    "header version": ("hdr", L.SH_VERSION, "slot format version"),
    "chunk table": ("table", 4 * 1 + 2, "slot chunk-checksum table mismatch"),
    "meta": ("meta", 3, "slot manifest checksum mismatch"),
}


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_flipped_byte_invalidates_slot(C, snap_env, region):
    rng = np.random.default_rng(5)
    a = make(C, snap_env)
    path = snap_env.scratch_arena("a")
    fill_slot(C, a, 0, 7, 3000, rng)
    fill_slot(C, a, 1, 8, CAP, rng, meta=b'{"step":8,"pad":"' + b"p" * 200 + b'"}')
    assert a.newest_complete() == 1
    where, off, problem = REGIONS[region]
    base = {"hdr": L.slot_offset, "table": L.table_offset, "meta": L.meta_offset}[where]
    L.flip_byte(path, base(1, CAP, META, CHUNK) + off)
    # A fresh view (the next process, a supervisor) and the writer itself both see it.
    views = [C.Arena.open(str(path), False)]
    if where == "hdr":
        views.append(a)  # header checks are never cached
    for v in views:
        info = v.slot_info(1)
        assert info["state"] == "COMPLETE" and not info["valid"]
        assert problem in info["problem"], info
        assert v.newest_complete() == 0  # falls back to the older COMPLETE slot
        with pytest.raises(CorruptSnapshot, match=re.escape(problem)):
            v.read_meta(1)
    # A data byte is not covered by the header: the per-chunk table catches it (flusher tests).


def test_state_word_is_not_trusted_alone(C, snap_env):
    """Forcing state=COMPLETE on a slot that never committed does not make it valid."""
    rng = np.random.default_rng(6)
    a = make(C, snap_env)
    path = snap_env.scratch_arena("a")
    fill_slot(C, a, 0, 1, 100, rng)
    a.begin_write(1, 2, b"{}")
    with open(path, "r+b") as f:
        f.seek(L.slot_offset(1, CAP, META, CHUNK) + L.SH_STATE)
        f.write(struct.pack("<I", L.COMPLETE))
    b = C.Arena.open(str(path), False)
    info = b.slot_info(1)
    assert info["state"] == "COMPLETE" and not info["valid"] and info["problem"]
    assert b.newest_complete() == 0


def test_unlink_removes_the_file(C, snap_env):
    a = make(C, snap_env, prefault=False)
    path = snap_env.scratch_arena("a")
    assert path.exists()
    a.unlink()
    assert not path.exists()
