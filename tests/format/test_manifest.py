"""Manifest validation (cudasnap/format/manifest.py): hostile or torn manifests are refused."""
from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch
from helpers import parts

from cudasnap.errors import CorruptSnapshot, IncompatibleSnapshot
from cudasnap.format import manifest as M


def good_manifest():
    tensors = []
    off = 0
    for name, dtype, shape in [("model.w", "float32", [4, 8]), ("model.b", "float32", [8]),
                               ("model.bn.num_batches_tracked", "int64", []),
                               ("optim.state.0.exp_avg", "bfloat16", [4, 8]),
                               ("model.empty", "float16", [0, 3])]:
        item = parts.itemsize(dtype)
        stride = [int(x) for x in torch.empty(shape).stride()]
        n = M.span_bytes(shape, stride, item)
        tensors.append({"name": name, "group": "model:model", "dtype": dtype, "shape": shape,
                        "stride": stride, "storage_offset": 0, "offset": off, "nbytes": n,
                        "phase": 1})
        off += (n + 15) // 16 * 16
    chunk = 4096
    return {"format": "cudasnap", "format_version": 1, "step": 41, "rank": 0, "world_size": 1,
            "tensors": tensors, "host": {"step": 41},
            "data": {"file": "data.bin", "bytes": off, "chunk_bytes": chunk,
                     "crc32c": [0] * -(-off // chunk)}}


def test_good_manifest_validates():
    m = good_manifest()
    assert m["data"]["bytes"] == 240  # BAD["range ends beyond data"] relies on it
    M.validate_manifest(m, "m")
    M.validate_manifest(json.loads(json.dumps(m)), "m")
    nodata = {k: v for k, v in m.items() if k != "data"}
    M.validate_manifest(nodata, "slot", need_data=False)


def _set(m, path, value):
    obj = m
    for p in path[:-1]:
        obj = obj[p]
    if value is KeyError:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


T0 = ("tensors", 0)
BAD = {
    "offset beyond data": (T0 + ("offset",), 10**6, "outside the data"),
    "range ends beyond data": (("tensors", 1, "offset"), 240 - 16, "outside the data"),
    "negative offset": (T0 + ("offset",), -4, "non-negative"),
    "offset is a float": (T0 + ("offset",), 0.0, "non-negative integers"),
    "offset is a bool": (T0 + ("offset",), True, "non-negative integers"),
    "misaligned offset": (("tensors", 1, "offset"), 130, "not aligned"),
    "wrong nbytes": (T0 + ("nbytes",), 127, "disagrees with shape"),
    "nbytes for another stride": (T0 + ("stride",), [16, 1], "disagrees with shape"),
    "bad dtype": (T0 + ("dtype",), "object", "unsupported dtype"),
    "dtype not a string": (T0 + ("dtype",), 7, "unsupported dtype"),
    "negative dim": (T0 + ("shape",), [-4, 8], "non-negative"),
    "shape/stride rank differ": (T0 + ("stride",), [8], "malformed"),
    "huge dims": (T0 + ("shape",), [2**60, 1], "non-negative integers"),
    "too many dims": (T0 + ("shape",), [1] * 65, "malformed"),
    "missing name": (T0 + ("name",), KeyError, "name"),
    "NUL in name": (T0 + ("name",), "a\x00b", "name"),
    "duplicate name": (("tensors", 1, "name"), "model.w", "duplicate"),
    "bad phase": (T0 + ("phase",), 2, "phase"),
    "group not a string": (T0 + ("group",), 5, "group"),
    "group missing": (T0 + ("group",), KeyError, "group"),
    "entry not an object": (T0, ["model.w"], "not an object"),
    "tensors not a list": (("tensors",), {"a": 1}, "must be a list"),
    "data file escapes": (("data", "file"), "../x", "data file"),
    "absolute data file": (("data", "file"), "/etc/passwd", "data file"),
    "nested data file": (("data", "file"), "data.bin/../../x", "data file"),
    "other data file": (("data", "file"), "other.bin", "data file"),
    "missing data": (("data",), KeyError, "missing 'data'"),
    "negative bytes": (("data", "bytes"), -1, "bad data size"),
    "tiny chunk": (("data", "chunk_bytes"), 16, "bad data size"),
    "crc count": (("data", "crc32c"), [0, 0], "does not match"),
    "crc out of range": (("data", "crc32c"), [2**32], "bad checksum"),
    "crc negative": (("data", "crc32c"), [-1], "bad checksum"),
    "format": (("format",), "torch", "not a cudasnap manifest"),
    "step negative": (("step",), -1, "bad step"),
    "step missing": (("step",), KeyError, "bad step"),
    "step a string": (("step",), "41", "bad step"),
    "host not an object": (("host",), [1], "'host' must be an object"),
    "bad rank": (("rank",), -1, "bad rank"),
    "bad world": (("world_size",), "2", "bad world_size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifest_is_rejected(case):
    path, value, match = BAD[case]
    m = good_manifest()
    _set(m, path, value)
    with pytest.raises(CorruptSnapshot, match=match) as ei:
        M.validate_manifest(m, "DIR/step-00000041/manifest.json")
    assert "DIR/step-00000041/manifest.json" in str(ei.value)


def test_not_an_object_and_future_version():
    with pytest.raises(CorruptSnapshot, match="not a JSON object"):
        M.validate_manifest([1], "m")
    m = good_manifest()
    m["format_version"] = 2
    with pytest.raises(IncompatibleSnapshot, match="format version 2"):
        M.validate_manifest(m, "m")


def test_every_single_tensor_field_mutation_is_caught_or_harmless():
    """Random integer perturbations of offsets/nbytes/shapes never pass validation with
    a byte range outside the data or a byte count that disagrees with the view."""
    rnd = random.Random(8)
    base = good_manifest()
    total = base["data"]["bytes"]
    for _ in range(300):
        m = copy.deepcopy(base)
        e = rnd.choice(m["tensors"])
        key = rnd.choice(["offset", "nbytes", "shape", "stride"])
        if key in ("offset", "nbytes"):
            e[key] += rnd.choice([-16, -4, -1, 1, 4, 16, total])
        else:
            if not e[key]:
                continue
            i = rnd.randrange(len(e[key]))
            e[key][i] += rnd.choice([-1, 1, 2])
        try:
            M.validate_manifest(m, "m")
        except CorruptSnapshot:
            continue
        for t in m["tensors"]:  # it passed: then it must really be sound
            item = parts.itemsize(t["dtype"])
            assert t["nbytes"] == M.span_bytes(t["shape"], t["stride"], item)
            assert 0 <= t["offset"] and t["offset"] + t["nbytes"] <= total
            assert t["offset"] % item == 0


def test_span_bytes_matches_torch_storage_extent():
    rnd = random.Random(2)
    for _ in range(200):
        shape = [rnd.randint(0, 5) for _ in range(rnd.randint(0, 4))]
        base = torch.empty(max(1, 1 + sum(shape) * 40), dtype=torch.float32)
        t = base.as_strided(shape, [rnd.randint(0, 6) for _ in shape], rnd.randint(0, 3)) \
            if shape else base[0]
        n = M.span_bytes(list(t.shape), list(t.stride()), 4)
        if t.numel() == 0:
            assert n == 0
        else:
            last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
            assert n == 4 * (last + 1)
            assert n == 4 * (max(sum(i * st for i, st in zip(ix, t.stride()))
                                 for ix in itertools.product(*[range(s) for s in t.shape])) + 1)


def test_tensor_entry_and_dtype_names():
    t = torch.randn(6, 4)[:, 1:3]
    e = M.tensor_entry("model.x", "model:model", t, 64, 1)
    assert e["shape"] == [6, 2] and e["stride"] == [4, 1] and e["storage_offset"] == 1
    assert e["nbytes"] == 4 * (5 * 4 + 1 + 1) and e["dtype"] == "float32"
    M.validate_tensors([e], 64 + e["nbytes"], "w")
    with pytest.raises(CorruptSnapshot, match="outside"):
        M.validate_tensors([e], 64 + e["nbytes"] - 1, "w")
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8,
               torch.complex128, torch.float8_e4m3fn):
        assert M.torch_dtype(M.dtype_name(dt)) is dt
        assert parts.itemsize(M.dtype_name(dt)) == torch.empty((), dtype=dt).element_size()
    with pytest.raises(IncompatibleSnapshot, match="not supported"):
        M.dtype_name(torch.quint8)
