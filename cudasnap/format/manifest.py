"""Snapshot manifest: the tensor table and its validation.

A manifest (JSON, also stored in each shared-memory slot) describes where each
tensor's bytes lie in the snapshot's flat data area::

    {"format": "cudasnap", "format_version": 1, "step": 41, "rank": 0, "world_size": 1,
     "tensors": [{"name": "model.fc.weight", "group": "model", "dtype": "float32",
                  "shape": [4, 8], "stride": [8, 1], "storage_offset": 0,
                  "offset": 0, "nbytes": 128, "phase": 1}, ...],
     "host": {...typed JSON, see cudasnap.format.codec...},
     "data": {"file": "data.bin", "bytes": N, "chunk_bytes": C, "crc32c": [...]}}

One typed schema (``Manifest``, ``TensorEntry``, ``DataSection``) serves
both places a manifest lives: a shared-memory slot holds the same JSON minus
its ``data`` section (rebuilt from the slot by ``data_section``; its bytes are
written by ``cudasnap.format.slot_manifest`` only, read by ``parse_slot_meta``) and a file on
disk or in an object store holds all of it plus its own CRC32C
(``manifest_crc32c``). ``parse_manifest`` is the one reader of manifest bytes.

``validate_manifest`` checks everything a hostile or torn file could get wrong
before a single data byte is read: types, dtypes, shape/stride/byte-count
agreement, ranges inside the data file, a data file name that cannot escape
the snapshot directory.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypedDict

from ..errors import CorruptSnapshot, IncompatibleSnapshot
from .paths import DATA

if TYPE_CHECKING:  # the stub only
    from cudasnap._C import SlotInfo

FORMAT = "cudasnap"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST_CRC = "manifest_crc32c"
MAX_MANIFEST_BYTES = 256 << 20


class TensorEntry(TypedDict, total=False):
    """One tensor's place in the flat data area (``param_index``/``state_key``/``aliases``
    only for optimizer state and aliased views)."""

    name: str
    group: str
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int
    offset: int
    nbytes: int
    phase: int
    param_index: int
    state_key: str
    aliases: list[str]
    shard: dict[str, Any]  # DTensor local shard: mesh, placements, offset (core.sharded)
    wrapper: dict[str, Any]  # an inner tensor of a tensor subclass (core.wrapped)


class DataSection(TypedDict):
    """Where the data bytes are and how to check them: always ``data.bin``."""

    file: str
    bytes: int
    chunk_bytes: int
    crc32c: list[int]


class Manifest(TypedDict, total=False):
    """A snapshot manifest, in a slot (no ``data``, no CRC) or on disk (both)."""

    format: str
    format_version: int
    step: int
    rank: int
    world_size: int
    job: str
    backend: str
    torch: str
    tensors: list[TensorEntry]
    host: dict[str, Any]
    data: DataSection
    created_unix: float
    slot_seq: int
    manifest_crc32c: int
    # The names torch.distributed.checkpoint's get_state_dict gives (core.state.dcp_names):
    # {"model": {tensor name: DCP name}, "optim": {optimizer key: [param FQN | None]}}.
    # Optional (older snapshots lack it); read by ``cudasnap export --to dcp``.
    dcp_names: dict[str, Any]
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4,
    "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_MAX_DIMS = 64


def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise IncompatibleSnapshot(f"dtype {name} is not supported in snapshots")
    return name


def dtype_names() -> list[str]:
    """The dtypes snapshots hold, by name."""
    return list(_ITEMSIZE)


_NAMES: dict[Any, str | None] = {}


def dtype_key(dtype: Any) -> str | None:
    """``dtype_name(dtype)``, or None for a dtype snapshots do not hold (no exception);
    cached: per-tensor loops call it."""
    name = _NAMES.get(dtype, "")
    if name == "":
        n = str(dtype).removeprefix("torch.")
        _NAMES[dtype] = name = n if n in _ITEMSIZE else None
    return name


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def span_bytes(shape: list[int], stride: list[int], itemsize: int) -> int:
    """Bytes from a view's first element to one past its last."""
    if any(s == 0 for s in shape):
        return 0
    return itemsize * (1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)))


def expand_params(group: dict[str, Any]) -> dict[str, Any]:
    """A param group as the host state stores it (``"params": [first index, count]`` in
    the optimizer's parameter order) with ``params`` as the index list
    ``Optimizer.state_dict()`` has."""
    g = dict(group)
    first, count = g["params"]
    g["params"] = list(range(int(first), int(first) + int(count)))
    return g


def tensor_entry(name: str, group: str, t: Any, offset: int, phase: int,
                 nbytes: int | None = None) -> dict[str, Any]:
    """A tensor table entry; ``nbytes``: the tensor's byte span when the caller already
    has it (``LiveTensor.nbytes``), else computed here (``span_bytes``)."""
    if nbytes is None:
        nbytes = span_bytes(list(t.shape), list(t.stride()), t.element_size())
    return {"name": name, "group": group, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
            "stride": list(t.stride()), "storage_offset": int(t.storage_offset()),
            "offset": int(offset), "nbytes": nbytes, "phase": phase}


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptSnapshot(f"{where}: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_DIM_LIMIT = 2**48


class _Refused(Exception):
    """A fast check found something: the full check says what."""


def _refuse(cond: bool, what: str = "") -> None:
    if not cond:
        raise _Refused


def validate_shard(info: Any, local_shape: list[int], check: Any) -> None:
    """Manifest validation of a ``shard`` entry (a DTensor's local shard: mesh, placements,
    offset; written by ``cudasnap.core.sharded.shard_info``); ``check(cond, what)`` reports a
    problem."""
    check(isinstance(info, dict), "shard must be an object")

    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**48 for x in v)

    gshape, mshape, off = info.get("global_shape"), info.get("mesh_shape"), info.get("offset")
    check(ints(gshape) and ints(mshape) and ints(off) and len(mshape) >= 1,
          "shard global_shape/mesh_shape/offset must be lists of non-negative integers")
    check(len(gshape) == len(local_shape) == len(off), "shard offset/global_shape rank "
          "disagrees with the tensor's shape")
    check(all(o + n <= g for o, n, g in zip(off, local_shape, gshape)),
          "shard lies outside its global shape")
    pl = info.get("placements")
    check(isinstance(pl, list) and len(pl) == len(mshape) and all(isinstance(p, str) for p in pl),
          "shard placements must be one string per mesh dimension")
    dims = info.get("mesh_dims")
    check(dims is None or (isinstance(dims, list) and len(dims) == len(mshape)
                           and all(isinstance(d, str) for d in dims)), "bad shard mesh_dims")
    coord = info.get("coord")
    check(coord is None or (ints(coord) and len(coord) == len(mshape)), "bad shard coord")


def validate_wrapper(rec: Any, check: Any) -> None:
    """Manifest validation of a ``wrapper`` record (an inner tensor of a tensor subclass,
    written by ``cudasnap.core.wrapped``); ``check(cond, what)`` reports a problem."""
    check(isinstance(rec, dict), "wrapper must be an object")
    check(all(isinstance(rec.get(k), str) for k in ("of", "attr", "class", "dtype")),
          "wrapper of/attr/class/dtype must be strings")
    inner, shape, stride = rec.get("inner"), rec.get("shape"), rec.get("stride")
    check(isinstance(inner, list) and len(inner) > 0 and all(isinstance(a, str) for a in inner)
          and rec.get("attr") in inner, "wrapper inner must list its tensor names")
    check(isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
          and all(type(v) is int and v >= 0 for v in shape + stride),
          "wrapper shape/stride must be lists of non-negative integers")


def _tensors_sound(tensors: list[Any], data_bytes: int) -> bool:
    """True only when ``_check_tensors`` would accept ``tensors``: the same rules, with
    no message built per entry (restore reads thousands of entries). False sends the
    table to ``_check_tensors``, which names the first problem."""
    seen: set[str] = set()
    add = seen.add
    sizes = _ITEMSIZE
    limit = _DIM_LIMIT
    for e in tensors:
        if type(e) is not dict:
            return False
        name, dt, shape, stride = e.get("name"), e.get("dtype"), e.get("shape"), e.get("stride")
        off, nbytes, group = e.get("offset"), e.get("nbytes"), e.get("group")
        if (type(name) is not str or not 0 < len(name) < 4096 or "\x00" in name
                or name in seen or type(dt) is not str or dt not in sizes
                or type(shape) is not list or type(stride) is not list
                or len(shape) != len(stride) or len(shape) > _MAX_DIMS
                or type(off) is not int or type(nbytes) is not int or off < 0 or nbytes < 0
                or type(group) is not str):
            return False
        add(name)
        last = 0
        empty = False
        for n, st in zip(shape, stride):
            if type(n) is not int or type(st) is not int or not (0 <= n < limit
                                                                  and 0 <= st < limit):
                return False
            if n == 0:
                empty = True
            last += (n - 1) * st
        itemsize = sizes[dt]
        if nbytes != (0 if empty else itemsize * (1 + last)) or off % itemsize \
                or off + nbytes > data_bytes:
            return False
        phase = e.get("phase", 1)
        if type(phase) is not int or not (phase == 0 or phase == 1):
            return False
        if "shard" in e or "wrapper" in e:
            try:
                if "wrapper" in e:
                    validate_wrapper(e["wrapper"], _refuse)
                if "shard" in e:
                    validate_shard(e["shard"], e["wrapper"]["shape"] if "wrapper" in e
                                   else shape, _refuse)
            except _Refused:
                return False
    return True


def validate_tensors(tensors: Any, data_bytes: int, where: str) -> None:
    """Raises CorruptSnapshot naming the first unsound tensor entry (see module doc)."""
    _need(isinstance(tensors, list), where, "'tensors' must be a list")
    if _tensors_sound(tensors, data_bytes):
        return
    _check_tensors(tensors, data_bytes, where)


def _check_tensors(tensors: list[Any], data_bytes: int, where: str) -> None:
    """The entry-by-entry check with a message for each problem (the reference rules)."""
    seen: set[str] = set()
    for i, e in enumerate(tensors):
        w = f"{where}: tensor #{i}"
        _need(isinstance(e, dict), w, "entry is not an object")
        name = e.get("name")
        _need(isinstance(name, str) and 0 < len(name) < 4096 and "\x00" not in name, w,
              "bad or missing name")
        _need(name not in seen, w, f"duplicate tensor name {name!r}")
        seen.add(name)
        w = f"{where}: tensor {name!r}"
        dt = e.get("dtype")
        _need(isinstance(dt, str) and dt in _ITEMSIZE, w, f"unsupported dtype {dt!r}")
        shape, stride = e.get("shape"), e.get("stride")
        _need(isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
              and len(shape) <= _MAX_DIMS, w, "shape/stride malformed")
        _need(all(_is_int(s) and 0 <= s < 2**48 for s in shape + stride), w,
              "shape/stride entries must be non-negative integers")
        off, nbytes = e.get("offset"), e.get("nbytes")
        _need(_is_int(off) and _is_int(nbytes) and off >= 0 and nbytes >= 0, w,
              "offset/nbytes must be non-negative integers")
        itemsize = _ITEMSIZE[dt]
        _need(nbytes == span_bytes(shape, stride, itemsize), w,
              f"nbytes {nbytes} disagrees with shape {shape}, stride {stride} of {dt}")
        _need(off % itemsize == 0, w, f"offset {off} not aligned to {dt}")
        _need(off + nbytes <= data_bytes, w,
              f"bytes {off}..{off + nbytes} lie outside the data ({data_bytes} bytes)")
        _need(_is_int(e.get("phase", 1)) and e.get("phase", 1) in (0, 1), w,
              "phase must be 0 or 1")
        # Required: restore dispatches on it (a missing one was a KeyError, not a fallback).
        _need(isinstance(e.get("group"), str), w, "group must be a string")
        if "wrapper" in e:
            validate_wrapper(e["wrapper"], lambda c, what, w=w: _need(c, w, what))
        if "shard" in e:  # (of the subclass, for a subclass's inner tensor)
            validate_shard(e["shard"], e["wrapper"]["shape"] if "wrapper" in e else shape,
                           lambda c, what, w=w: _need(c, w, what))


def validate_manifest(m: Any, where: str, *, need_data: bool = True) -> None:
    """Raises CorruptSnapshot / IncompatibleSnapshot unless ``m`` is a sound manifest."""
    _need(isinstance(m, dict), where, "manifest is not a JSON object")
    _need(m.get("format") == FORMAT, where, f"not a cudasnap manifest (format={m.get('format')!r})")
    ver = m.get("format_version")
    if not (_is_int(ver) and ver in SUPPORTED_VERSIONS):
        raise IncompatibleSnapshot(
            f"{where}: format version {ver!r}; this cudasnap reads {list(SUPPORTED_VERSIONS)}")
    _need(_is_int(m.get("step")) and m["step"] >= 0, where, "bad step")
    if need_data:
        d = m.get("data")
        _need(isinstance(d, dict), where, "missing 'data' section")
        _need(d.get("file") == DATA, where,
              f"data file must be 'data.bin', got {d.get('file')!r}")
        nbytes, chunk, crcs = d.get("bytes"), d.get("chunk_bytes"), d.get("crc32c")
        _need(_is_int(nbytes) and nbytes >= 0 and _is_int(chunk) and chunk >= 4096, where,
              "bad data size or chunk size")
        # Integer ceil: nbytes / chunk is a float and overflows for a hostile 10**400.
        _need(isinstance(crcs, list) and len(crcs) == -(-nbytes // chunk), where,
              "chunk checksum list does not match the data size")
        _need(all(_is_int(c) and 0 <= c < 2**32 for c in crcs), where, "bad checksum entries")
        validate_tensors(m.get("tensors"), nbytes, where)
    _need("host" in m, where, "missing 'host' object")  # restore reads it unconditionally
    _need(isinstance(m["host"], dict), where, "'host' must be an object")
    for key in ("rank", "world_size"):
        if key in m:
            _need(_is_int(m[key]) and m[key] >= 0, where, f"bad {key}")


def data_section(nbytes: int, chunk_bytes: int, crcs: list[int]) -> DataSection:
    """The manifest's ``data`` section: built here only (flush and slot restore)."""
    return {"file": DATA, "bytes": int(nbytes), "chunk_bytes": int(chunk_bytes),
            "crc32c": [int(c) for c in crcs]}


def head(step: int | None = None, **fields: Any) -> dict[str, Any]:
    """The identifying fields every manifest starts with (``format``, version, ...)."""
    out: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
    if step is not None:
        out["step"] = step
    out.update(fields)
    return out


def manifest_crc(manifest: dict[str, Any]) -> int:
    """CRC32C of a manifest's canonical JSON (without its own checksum field).

    The data chunks have CRCs; this covers the rest: a flipped digit in an
    offset, a learning rate or an RNG state must not restore silently.
    JSON numbers and strings written by ``json`` read back to the same text.
    """
    from .._native import native

    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC}
    try:
        text = json.dumps(body, separators=(",", ":"), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptSnapshot(f"manifest cannot be checksummed: {e}") from e
    return int(native().crc32c(text.encode()))


def stored_manifest(meta: dict[str, Any], info: SlotInfo, chunk_bytes: int,
                    crcs: list[int], extra: dict[str, Any] | None = None) -> bytes:
    """A slot's manifest completed for storage (disk or object): step, provenance, the data
    section and its own CRC; ``info``: the slot's ``slot_info``."""
    import time

    manifest = dict(meta)
    manifest.update(head(int(info["step"]), created_unix=time.time(), slot_seq=int(info["seq"])))
    manifest["data"] = data_section(int(info["data_bytes"]), chunk_bytes, crcs)
    if extra:
        manifest.update(extra)
    return encode_manifest(manifest)


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The file form of a complete manifest: its CRC added, compact JSON."""
    manifest[MANIFEST_CRC] = manifest_crc(manifest)
    return json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parses and fully validates manifest file bytes, before any data byte is read."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptSnapshot(f"{where} is {len(raw)} bytes, larger than any manifest")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptSnapshot(f"{where} is not valid JSON: {e}") from e
    if isinstance(manifest, dict) and MANIFEST_CRC in manifest:
        if manifest[MANIFEST_CRC] != manifest_crc(manifest):
            raise CorruptSnapshot(f"{where}: manifest checksum mismatch (the file was damaged)")
    validate_manifest(manifest, where)
    if MANIFEST_CRC not in manifest:
        # write_slot always adds it: without it a damaged offset or lr would load silently.
        raise CorruptSnapshot(f"{where}: no {MANIFEST_CRC} field (damaged or not written by "
                              "cudasnap)")
    return manifest  # type: ignore[no-any-return]


def parse_slot_meta(raw: bytes | str, where: str) -> dict[str, Any]:
    """A slot's manifest JSON (no ``data`` section yet; written by
    ``cudasnap.format.slot_manifest``): a JSON object, else CorruptSnapshot."""
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:  # CRC-consistent, yet not JSON
        raise CorruptSnapshot(f"{where}: manifest is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise CorruptSnapshot(f"{where}: manifest is not a JSON object")
    return meta
