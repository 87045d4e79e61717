"""Hostile and random input (hypothesis): manifests, manifest files, arena files, host state.

Properties, for every generated input:
* ``manifest.validate_manifest`` / ``posix.load_manifest`` either accept it or raise a
  ``cudasnap.SnapshotError`` subclass with a message naming the file -- never another
  exception, never a crash;
* a manifest that is accepted describes only bytes inside ``data.bin`` (size checked
  against the file before any read; every tensor view built the way restore builds
  it stays inside the buffer);
* a mutated staging-arena file (``_C.Arena.open`` + ``slot_info`` and the readers of
  valid slots) only ever raises SnapshotError subclasses; a slot it calls valid is
  readable end to end;
* ``codec.decode`` of any JSON raises only CorruptSnapshot.

Bounded here (CUDASNAP_FUZZ_EXAMPLES, default 300 per property); bench/fuzz.py runs
longer.
"""
from __future__ import annotations

import copy
import ctypes
import json
import os
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import parts
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cudasnap._native import native
from cudasnap.errors import CorruptSnapshot, SnapshotError
from cudasnap.format import codec, paths
from cudasnap.format import manifest as M
from cudasnap.snapshotter import Snapshotter
from cudasnap.storage import posix
from tools.faults import layout as L
from tools.faults.trainlib import Job

EXAMPLES = int(os.environ.get("CUDASNAP_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 500,
                suppress_health_check=list(HealthCheck))
SHM = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))

json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
             | st.sampled_from([0, 1, -1, 4096, 2**31, 2**32, 2**48, 2**63, 2**64, 10**400])
             | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
             | st.sampled_from(["data.bin", "../data.bin", "/etc/passwd", "data.bin\x00",
                                "float32", "uint8", "model:model", "cudasnap", "__tensor__"]))
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=5)
                          | st.dictionaries(st.text(max_size=10) | st.sampled_from(
                              ["name", "dtype", "shape", "stride", "offset", "nbytes", "data",
                               "file", "bytes", "chunk_bytes", "crc32c", "tensors", "host"]),
                              c, max_size=5), max_leaves=20)


# ------------------------------------------------------------- a real snapshot

@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """One real flushed snapshot: (directory, manifest dict, raw manifest bytes)."""
    d = tmp_path_factory.mktemp("fuzz") / "ckpt"
    job = f"fz{uuid.uuid4().hex[:8]}"
    j = Job(dim=16)
    snap = Snapshotter(j.model, j.opt, directory=d, job=job, extra=j.extra(), chunk_bytes=4096,
                       copy_threads=1)
    try:
        for k in range(2):
            j.step()
            snap.boundary(k)
            snap.wait()
        path = snap.flush()
    finally:
        snap.close()
    raw = (path / paths.MANIFEST).read_bytes()
    return path, json.loads(raw), raw


def _check_error(e: BaseException, where: str) -> None:
    event(f"refused: {type(e).__name__}")
    assert isinstance(e, SnapshotError), f"{type(e).__name__}: {e}"
    assert str(e).strip(), "error without a message"
    assert where in str(e) or "checksum" in str(e), str(e)


def _invariants(m: dict) -> None:
    """What validate_manifest guarantees about an accepted manifest."""
    d = m["data"]
    assert d["file"] == "data.bin"
    assert len(d["crc32c"]) == -(-d["bytes"] // d["chunk_bytes"])
    for e in m["tensors"]:
        item = parts.itemsize(e["dtype"])
        assert e["nbytes"] == M.span_bytes(e["shape"], e["stride"], item)
        assert 0 <= e["offset"] and e["offset"] + e["nbytes"] <= d["bytes"]
        assert "\x00" not in e["name"]


def _views_stay_inside(m: dict, buf: torch.Tensor) -> None:
    """Builds every tensor view exactly as TrainingState.apply does; all inside ``buf``."""
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for e in m["tensors"]:
        off, n = e["offset"], e["nbytes"]
        dt = M.torch_dtype(e["dtype"])
        if not n:
            continue
        flat = buf[off:off + n].view(dt)
        v = flat.as_strided(e["shape"], e["stride"])
        item = v.element_size()
        last = v.data_ptr() + item * sum((s - 1) * st_ for s, st_ in zip(v.shape, v.stride()))
        assert lo <= v.data_ptr() and last + item <= hi


# --------------------------------------------------------------- manifests

@pytest.mark.slow
@FUZZ
@given(json_value)
def test_validate_manifest_on_random_json(value):
    try:
        M.validate_manifest(value, "fuzz.json")
    except Exception as e:  # noqa: BLE001
        _check_error(e, "fuzz.json")
    else:
        _invariants(value)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_manifest(draw, base):
    m = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(m) if p]
        path = draw(st.sampled_from(paths))
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["set", "set", "del", "int", "neg"]))
        key = path[-1]
        if op == "del":
            del parent[key]
        elif op == "int":
            parent[key] = draw(st.sampled_from([0, 1, 3, 4095, 4096, 2**32, 2**48, 2**62,
                                                10**30]))
        elif op == "neg":
            cur = parent[key]
            parent[key] = -cur if isinstance(cur, int) and not isinstance(cur, bool) else [cur]
        else:
            parent[key] = draw(json_value)
    return m


@FUZZ
@given(st.data())
def test_load_manifest_of_mutated_manifests_and_read_data(snapshot, tmp_path_factory, data):
    """Structured mutations, with the manifest CRC recomputed (so validation is what
    stands between them and the reader) or not; an accepted one reads only data.bin."""
    path, base, _ = snapshot
    m = data.draw(mutated_manifest(base))
    fix_crc = data.draw(st.booleans())
    if fix_crc and isinstance(m, dict):
        try:
            m[M.MANIFEST_CRC] = M.manifest_crc(m)
        except SnapshotError:
            pass
    d = tmp_path_factory.mktemp("m") / "step-00000001"
    d.mkdir()
    os.link(path / paths.DATA, d / paths.DATA)
    man = d / paths.MANIFEST
    try:
        man.write_text(json.dumps(m))
    except (ValueError, TypeError):
        return
    try:
        got = posix.load_manifest(man)
    except Exception as e:  # noqa: BLE001
        _check_error(e, str(man))
        return
    _invariants(got)
    try:
        buf = posix.read_data(d, got, threads=1)
    except Exception as e:  # noqa: BLE001
        _check_error(e, str(d))
        return
    assert buf.numel() == (d / paths.DATA).stat().st_size
    _views_stay_inside(got, buf)
    event("accepted and read")


@FUZZ
@given(st.data())
def test_load_manifest_of_byte_mutated_files(snapshot, tmp_path_factory, data):
    """Flipped, deleted, inserted bytes and truncations of a real manifest file: refused,
    or (only when the damage does not change the parsed content) loaded unchanged."""
    _, base, raw = snapshot
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "del", "ins", "trunc"]))
        i = data.draw(st.integers(0, max(len(b) - 1, 0)))
        if op == "flip" and b:
            b[i] ^= data.draw(st.integers(1, 255))
        elif op == "del":
            del b[i:i + data.draw(st.integers(1, 64))]
        elif op == "ins":
            b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            del b[i:]
    man = tmp_path_factory.mktemp("b") / paths.MANIFEST
    man.write_bytes(bytes(b))
    try:
        got = posix.load_manifest(man)
    except Exception as e:  # noqa: BLE001
        _check_error(e, str(man))
        return
    assert got == base


def test_deep_nesting_is_refused_not_a_crash(tmp_path):
    """JSON nested deeper than the parser, the checksum or the decoder can recurse."""
    man = tmp_path / paths.MANIFEST
    for depth in (50, 400, 900, 5000, 100000):
        head = '{"format":"cudasnap","format_version":1,"step":1,"manifest_crc32c":0,"host":'
        man.write_text(head + '{"x":' * depth + "{}" + "}" * depth + "}")
        with pytest.raises(SnapshotError):
            posix.load_manifest(man)
        try:  # decodes, or CorruptSnapshot: never RecursionError
            codec.loads('{"a":' * depth + "1" + "}" * depth)
        except CorruptSnapshot:
            pass
    deep: dict = {}
    inner = deep
    for _ in range(5000):  # built in Python: deeper than decode() can recurse
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(CorruptSnapshot, match="nested too deeply"):
        codec.decode(deep, "host")


def test_huge_numbers_are_refused_with_a_message():
    m = {"format": "cudasnap", "format_version": 1, "step": 1, "tensors": [],
         "data": {"file": "data.bin", "bytes": 10**400, "chunk_bytes": 4096, "crc32c": []}}
    with pytest.raises(CorruptSnapshot, match="checksum list"):
        M.validate_manifest(m, "x")
    m["format_version"] = True
    with pytest.raises(SnapshotError, match="format version"):
        M.validate_manifest(m, "x")


# ------------------------------------------------------------------- codec

_TENSOR_DTYPES = ["float32", "int64", "uint8", "bool", "bfloat16", "quint8", "qint32",
                  "float8_e4m3fn", "load", "__class__", "Tensor", "complex32", "", "x" * 40]
_NP_DTYPES = ["<f4", "|u1", "O", "|V8", "S0", "U3", "<M8[s]", "[('a','<i4')]", "i8,O", ">c16",
              "V0", "zz", "<f16"]


def _b64(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode()


tagged = st.one_of(
    st.builds(lambda t, v: {t: v}, st.sampled_from(parts.codec_tags()), json_value),
    st.builds(lambda dt, shape, b: {"__tensor__": {"dtype": dt, "shape": shape, "data": _b64(b)}},
              st.sampled_from(_TENSOR_DTYPES),
              st.lists(st.integers(-2, 2**40) | st.floats(), max_size=3), st.binary(max_size=32)),
    st.builds(lambda dt, shape, b: {"__ndarray__": {"dtype": dt, "shape": shape,
                                                    "data": _b64(b)}},
              st.sampled_from(_NP_DTYPES), st.lists(st.integers(-2, 2**40), max_size=3),
              st.binary(max_size=32)),
    st.builds(lambda v: {"__float__": v}, json_leaf),
    st.builds(lambda v: {"__dict__": v}, st.lists(st.lists(json_value, max_size=3), max_size=3)),
)
codec_value = st.recursive(json_leaf | tagged, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12)


@FUZZ
@given(codec_value)
def test_codec_decode_raises_only_corrupt_snapshot(value):
    try:
        codec.decode(value, "host")
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, CorruptSnapshot), f"{type(e).__name__}: {e}"
        assert str(e)


# ------------------------------------------------------------ arena files

CAP, META, CHUNK = 3 * 4096 + 100, 5000, 4096


@pytest.fixture(scope="module")
def arena_template():
    """Raw bytes of a 2-slot arena with both slots COMPLETE."""
    C = native()
    path = SHM / f"cudasnap-fz{uuid.uuid4().hex[:8]}-tmpl.arena"
    a = C.Arena.create(str(path), 2, CAP, META, CHUNK, "fuzz", True)
    rng = np.random.default_rng(0)
    for slot, step, n in ((0, 1, CAP), (1, 2, 5000)):
        a.begin_write(slot, step, json.dumps({"step": step}).encode())
        payload = rng.integers(0, 256, n, dtype=np.uint8)
        np.frombuffer(a.data_view(slot, n), dtype=np.uint8)[:] = payload
        nch = -(-n // CHUNK)
        table = (ctypes.c_uint32 * nch).from_address(a.table_ptr(slot))
        for c in range(nch):
            table[c] = C.crc32c(payload[c * CHUNK:(c + 1) * CHUNK].tobytes())
        a.commit(slot, step, n)
    raw = path.read_bytes()
    del a
    path.unlink()
    yield raw


_U64_FIELDS = [L.AH_NUM_SLOTS, L.AH_STRIDE, L.AH_DATA_CAP, L.AH_META_CAP, L.AH_CHUNK,
               L.AH_MAX_CHUNKS, L.AH_TOTAL]
_SLOT_FIELDS = [L.SH_STATE, L.SH_SEQ, L.SH_STEP, L.SH_DATA_BYTES, L.SH_META_BYTES,
                L.SH_NUM_CHUNKS, L.SH_VERSION]
_VALUES = [0, 1, 2, 3, 8, 9, 4095, 4096, CAP, CAP + 1, META + 1, 2**31, 2**32 - 1, 2**63,
           2**64 - 1]


def _fix_crcs(b: bytearray, fix_slots: bool, fix_tables: bool) -> None:
    C = native()
    hdr = bytearray(b[:L.AH_SIZE])
    struct.pack_into("<I", hdr, L.AH_CRC, 0)
    struct.pack_into("<I", b, L.AH_CRC, C.crc32c(bytes(hdr)))
    if not fix_slots:
        return
    for slot in range(2):
        off = L.slot_offset(slot, CAP, META, CHUNK)
        if off + L.SH_SIZE > len(b):
            return
        if fix_tables:
            n_ch = min(L.u64(b, off + L.SH_NUM_CHUNKS), L.max_chunks(CAP, CHUNK))
            t = L.table_offset(slot, CAP, META, CHUNK)
            struct.pack_into("<I", b, off + L.SH_TABLE_CRC, C.crc32c(bytes(b[t:t + 4 * n_ch])))
            mlen = min(L.u64(b, off + L.SH_META_BYTES), META)
            mo = L.meta_offset(slot, CAP, META, CHUNK)
            struct.pack_into("<I", b, off + L.SH_META_CRC, C.crc32c(bytes(b[mo:mo + mlen])))
        sh = bytearray(b[off:off + L.SH_SIZE])
        struct.pack_into("<I", sh, L.SH_HEADER_CRC, 0)
        struct.pack_into("<I", sh, L.SH_STATE, L.COMPLETE)
        struct.pack_into("<I", b, off + L.SH_HEADER_CRC, C.crc32c(bytes(sh)))


@st.composite
def mutated_arena(draw, raw):
    b = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["ah-field", "slot-field", "byte", "byte"]))
        if kind == "ah-field":
            off = draw(st.sampled_from(_U64_FIELDS))
            width = 4 if off == L.AH_NUM_SLOTS else 8
            v = draw(st.sampled_from(_VALUES)) % (1 << (8 * width))
            b[off:off + width] = v.to_bytes(width, "little")
        elif kind == "slot-field":
            slot = draw(st.integers(0, 1))
            f = draw(st.sampled_from(_SLOT_FIELDS))
            width = 4 if f in (L.SH_STATE, L.SH_VERSION) else 8
            v = draw(st.sampled_from(_VALUES)) % (1 << (8 * width))
            off = L.slot_offset(slot, CAP, META, CHUNK) + f
            b[off:off + width] = v.to_bytes(width, "little")
        else:
            region = draw(st.sampled_from(["ah", "sh0", "sh1", "any"]))
            base = {"ah": 0, "sh0": L.slot_offset(0, CAP, META, CHUNK),
                    "sh1": L.slot_offset(1, CAP, META, CHUNK), "any": 0}[region]
            span = {"ah": L.AH_SIZE, "sh0": L.SH_SIZE, "sh1": L.SH_SIZE, "any": len(b)}[region]
            i = base + draw(st.integers(0, span - 1))
            b[i] ^= draw(st.integers(1, 255))
    fix = draw(st.sampled_from(["none", "arena", "slots", "all"]))
    if fix != "none":
        _fix_crcs(b, fix in ("slots", "all"), fix == "all")
    if draw(st.integers(0, 9)) == 0:
        del b[draw(st.integers(0, len(b) - 1)):]
    return bytes(b)


@FUZZ
@given(st.data())
def test_mutated_arena_files_never_crash_the_reader(arena_template, data):
    C = native()
    raw = data.draw(mutated_arena(arena_template))
    path = SHM / f"cudasnap-fz{os.getpid()}-mut.arena"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, raw)
    finally:
        os.close(fd)
    try:
        for writable in (False, True):
            try:
                a = C.Arena.open(str(path), writable)
            except Exception as e:  # noqa: BLE001
                assert isinstance(e, SnapshotError), f"{type(e).__name__}: {e}"
                assert str(path) in str(e)
                event(f"open refused: {str(e).split(path.name)[-1][:40]}")
                continue
            assert a.total_bytes <= len(raw)
            for i in range(a.num_slots):
                info = a.slot_info(i)
                if not info["valid"]:
                    for reader in (a.read_meta, a.read_table):
                        with pytest.raises(CorruptSnapshot):
                            reader(i)
                    continue
                event("a valid slot")
                meta = a.read_meta(i)
                table = a.read_table(i)
                assert len(meta) == info["meta_bytes"] and len(table) == info["num_chunks"]
                view = a.data_view(i, info["data_bytes"])
                C.crc32c(view)  # every byte of a valid slot is mapped and readable
                C.verify_buffer(a.data_ptr(i), info["data_bytes"], a.chunk_bytes, table, 1)
            a.newest_complete()
            if writable:
                a.pick_write_slot()
            del a
    finally:
        path.unlink(missing_ok=True)


def test_arena_template_is_valid(arena_template):
    """The fuzzer starts from a good arena (else it would test nothing)."""
    C = native()
    path = SHM / f"cudasnap-fz{os.getpid()}-ok.arena"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, arena_template)
    os.close(fd)
    try:
        a = C.Arena.open(str(path), False)
        assert [a.slot_info(i)["valid"] for i in range(2)] == [True, True]
        del a
        b = bytearray(arena_template)
        _fix_crcs(b, True, True)
        assert bytes(b) == arena_template  # the CRC fixer agrees with the engine
    finally:
        path.unlink(missing_ok=True)

