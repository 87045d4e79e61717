"""Typed JSON codec (cudasnap/format/codec.py): exact round trips, no pickle, clear errors."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from cudasnap.errors import ConfigError, CorruptSnapshot
from cudasnap.format import codec


def _raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a, b, path="v"):
    """Deep equality that also checks types, dtypes, shapes and NaNs."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_raw(a), _raw(b)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def roundtrip(v):
    text = codec.dumps(v)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    return codec.loads(text)


@pytest.mark.parametrize("value", [
    None, True, False, 0, -1, 2**80, "", "späm\u2603", 1.5, -0.0, 1e308,
    (1, 2, 3), (), ((1, (2,)), [3, (4, 5)]), [(), [], {}],
    {1: "a", 2: "b"}, {(1, 2): 3}, {None: 1, True: 2, 1.5: 3}, {"__tuple__": 1, "x": 2},
    {"a": {"b": {"c": [1, {"d": (1.0,)}]}}},
    float("nan"), float("inf"), float("-inf"), [float("nan"), {"k": float("-inf")}],
    b"", b"\x00\xffbytes", {"b": b"\x01" * 1000},
], ids=repr)
def test_plain_values_round_trip(value):
    same(value, roundtrip(value))


def test_bytes_like_become_bytes():
    assert roundtrip(bytearray(b"xy")) == b"xy" and roundtrip(memoryview(b"zz")) == b"zz"


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4),
    lambda: torch.randn(4, 6).t(),  # non-contiguous
    lambda: torch.arange(10, dtype=torch.int64)[::3],
    lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(5, dtype=torch.float64),
    lambda: torch.randn(2, 3).to(torch.bfloat16),
    lambda: torch.randn(2, 2, dtype=torch.complex64),
    lambda: torch.zeros(0, 3),
    lambda: torch.tensor(3.5),  # 0-d: e.g. a scheduler's or optimizer's scalar state
    lambda: torch.tensor(7, dtype=torch.int64),
    lambda: torch.tensor(True),
    lambda: torch.randn(3, requires_grad=True),
], ids=["f32", "transposed", "strided-int64", "bool", "f64", "bf16", "c64", "empty", "0d-f32",
        "0d-i64", "0d-bool", "requires-grad"])
def test_tensors_round_trip(make):
    t = make()
    got = roundtrip({"t": t, "in": [t, (t,)]})
    want = t.detach()
    for g in (got["t"], got["in"][0], got["in"][1][0]):
        assert g.dtype == want.dtype and g.shape == want.shape and g.is_contiguous()
        assert torch.equal(_raw(g), _raw(want))  # bit for bit


@pytest.mark.parametrize("arr", [
    np.arange(12, dtype=np.int32).reshape(3, 4), np.arange(12.0).reshape(3, 4).T,
    np.array([1.5, np.nan], dtype=">f8"), np.zeros((0,), np.uint16), np.array(5, np.int8),
    np.array([True, False]), np.array([1 + 2j], np.complex128),
], ids=["i32", "f64-T", "big-endian", "empty", "0d", "bool", "c128"])
def test_numpy_arrays_round_trip(arr):
    got = roundtrip(arr)
    assert got.dtype == arr.dtype and got.shape == arr.shape
    assert got.tobytes() == np.ascontiguousarray(arr).tobytes()
    assert got.flags.writeable  # an owned copy, not a view of the JSON text


def test_numpy_scalars_become_python_scalars():
    v = roundtrip({"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True),
                   "n": np.float64("nan")})
    assert v["i"] == 3 and type(v["i"]) is int and v["f"] == 0.5 and v["b"] is True
    assert math.isnan(v["n"])


def test_rng_states_round_trip_and_reproduce_draws():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    g = torch.Generator().manual_seed(11)
    torch.rand(5), random.random(), np.random.rand(), torch.rand(3, generator=g)
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": np.random.get_state(), "gen": g.get_state()}
    want = (torch.rand(4), random.random(), np.random.rand(3), torch.rand(2, generator=g))
    np.random.randn()  # numpy keeps a cached gaussian: it must be part of the state
    states["numpy_gauss"] = np.random.get_state()
    back = roundtrip(states)
    same(states["python"], back["python"])
    torch.set_rng_state(back["torch"])
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    g2 = torch.Generator()
    g2.set_state(back["gen"])
    got = (torch.rand(4), random.random(), np.random.rand(3), torch.rand(2, generator=g2))
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert np.array_equal(got[2], want[2]) and torch.equal(got[3], want[3])
    np.random.set_state(back["numpy_gauss"])
    a = np.random.randn(3)
    np.random.set_state(states["numpy_gauss"])
    assert np.array_equal(a, np.random.randn(3))


def test_non_serialisable_object_names_the_key():
    with pytest.raises(ConfigError) as ei:
        codec.dumps({"extra": {"sched": {"state": {"lr_lambdas": [None, lambda e: e]}}}}, "host")
    msg = str(ei.value)
    assert "host.extra.sched.state.lr_lambdas[1]" in msg and "function" in msg
    assert "pickle" in msg

    class Opaque:
        pass

    with pytest.raises(ConfigError, match=r"state\[3\]\.x.*Opaque"):
        codec.encode({3: {"x": Opaque()}})
    with pytest.raises(ConfigError, match="object arrays"):
        codec.encode({"a": np.array([object()], dtype=object)})
    with pytest.raises(ConfigError, match=r"state\.s.*set"):
        codec.encode({"s": {1, 2}})
    with pytest.raises(ConfigError, match="too large"):
        codec.encode({"big": torch.zeros(codec.MAX_INLINE_TENSOR_BYTES // 4 + 1)})
    with pytest.raises(ConfigError, match="sparse"):
        codec.encode({"sp": torch.eye(3).to_sparse()})


@pytest.mark.parametrize("text,match", [
    ("{nope", "not valid JSON"),
    ('{"__tuple__": [1], "x": 2}', "malformed tagged"),
    ('{"__float__": "zero"}', "malformed __float__"),
    ('{"__bytes__": "!!!"}', "malformed __bytes__"),
    ('{"__tensor__": {"dtype": "float32", "shape": [3], "data": "AAAA"}}', "needs 12 bytes"),
    ('{"__tensor__": {"dtype": "Tensor", "shape": [1], "data": "AAAA"}}', "dtype"),
    ('{"__tensor__": {"dtype": "nosuch", "shape": [1], "data": ""}}', "bad tensor encoding"),
    ('{"__tensor__": {"dtype": "uint8", "shape": [-1, -1], "data": "AA=="}}', "needs"),
    ('{"__ndarray__": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}}', "object dtype"),
    ('{"__ndarray__": {"dtype": "<f4", "shape": [3], "data": "AAAA"}}', "malformed __ndarray__"),
    ('{"__dict__": [[[1], 2]]}', "malformed __dict__"),
    ('{"__dict__": 5}', "malformed __dict__"),
])
def test_malformed_input_is_corrupt_snapshot(text, match):
    with pytest.raises(CorruptSnapshot, match=match):
        codec.loads(text)
