"""Typed JSON codec for host state: no pickle, ever.

Host-side state (RNG states, optimizer hyper-parameters, scheduler and sampler
``state_dict``s) is stored as JSON. Types JSON lacks are tagged objects:

=================  ===========================================================
Python value       encoding
=================  ===========================================================
tuple              ``{"__tuple__": [...]}``
non-str-key dict   ``{"__dict__": [[key, value], ...]}`` (also for keys like ``"__x"``)
float nan/inf      ``{"__float__": "nan" | "inf" | "-inf"}``
bytes              ``{"__bytes__": "<base64>"}``
torch.Tensor       ``{"__tensor__": {"dtype", "shape", "data": "<base64>"}}`` (small, host)
numpy.ndarray      ``{"__ndarray__": {"dtype", "shape", "data": "<base64>"}}``
numpy scalar       the Python scalar
torch.dtype        ``{"__dtype__": "float32"}``
torch.Size         ``{"__size__": [...]}`` (before tuple: it is one)
torch.device       ``{"__device__": "cuda:0"}``
=================  ===========================================================

(The torch types appear in a tensor subclass's ``__tensor_flatten__`` context, which a
snapshot of its inner tensors records: cudasnap.core.wrapped.)

Anything else raises :class:`~cudasnap.errors.ConfigError` naming the key path,
so a user learns at the first snapshot, not at the first failure, that a piece
of state cannot be saved without pickle.
"""
from __future__ import annotations

import base64
import json
import math
import sys
from typing import Any

from ..errors import ConfigError, CorruptSnapshot

MAX_INLINE_TENSOR_BYTES = 16 << 20
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
_TAGS = ("__tuple__", "__dict__", "__float__", "__bytes__", "__tensor__", "__ndarray__",
         "__dtype__", "__size__", "__device__")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


_DEVICES = ("cpu", "cuda")


def odd_tensor(t: Any, raw: bool = True) -> str | None:
    """Why the bytes of tensor ``t`` cannot be snapshotted (a phrase to follow its name), or
    None: a NestedTensor, a tensor without data (meta device), a sparse or other non-strided
    layout, and with ``raw`` (state the copy engine reads as raw memory) a device it does
    not copy from (host state goes through ``Tensor.to("cpu")``: any device with data).
    Reads only metadata (no dispatch, no sizes: a strided NestedTensor raises on
    ``.shape``)."""
    import torch

    if t.is_nested:
        return (f"is a NestedTensor (layout {t.layout}), whose bytes are not one strided "
                "span: cudasnap cannot snapshot it; keep it out of the snapshotted state "
                "(e.g. register_buffer(..., persistent=False)) or store its components "
                "(t.unbind()) as plain tensors")
    dev = t.device.type
    if dev == "meta":
        return ("is on the meta device: it has no data (deferred initialization leaves "
                "tensors there); materialize it before snapshotting (module.to_empty(device=...) "
                "and initialize or load it), or keep it out of the snapshotted state (e.g. "
                "register_buffer(..., persistent=False))")
    if raw and dev not in _DEVICES:
        return (f"is on device {t.device}: cudasnap copies CPU and CUDA tensors only; move it "
                "to the CPU or the training GPU")
    if t.is_sparse or t.layout != torch.strided:
        return f"has layout {t.layout}: sparse/non-strided tensors are not supported"
    return None


def wrapper_subclass(t: Any) -> bool:
    """True for a tensor subclass whose bytes do not live in its own storage (a
    ``__torch_dispatch__`` wrapper such as DTensor or a torchao quantized tensor, or a
    ``__tensor_flatten__`` one): its ``data_ptr`` is not its data."""
    import torch

    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    return getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__ or \
        hasattr(t, "__tensor_flatten__")


def host_tensor_refusal(t: Any) -> str | None:
    """``odd_tensor`` for a tensor in host state (``extra``, ``boundary(**values)``), which
    the codec reads through torch: also a wrapper subclass other than DTensor (whose
    ``to("cpu")`` gives no plain bytes)."""
    why = odd_tensor(t, raw=False)
    if why is None and wrapper_subclass(t) and type(t).__name__ != "DTensor":
        why = (f"is a {type(t).__module__}.{type(t).__qualname__}, a tensor subclass whose "
               "bytes do not live in its own storage; store its plain inner tensors instead")
    return why


def _encode_tensor(t: Any, path: str) -> dict[str, Any]:
    import torch

    why = host_tensor_refusal(t)
    if why is not None:
        raise ConfigError(f"cannot snapshot {path}: the tensor {why}")
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_INLINE_TENSOR_BYTES:
        raise ConfigError(
            f"cannot snapshot {path}: a {nbytes}-byte tensor inside host state is too large to "
            f"inline (limit {MAX_INLINE_TENSOR_BYTES}); register it as a module buffer instead")
    try:
        c = t.detach().to("cpu").contiguous()
        # reshape(-1): view(uint8) refuses 0-d tensors of wider dtypes (an optimizer's step).
        raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    except (RuntimeError, NotImplementedError, TypeError) as e:  # a subclass torch refuses
        raise ConfigError(f"cannot snapshot {path}: its {type(t).__qualname__} cannot be read "
                          f"as plain bytes: {e}") from e
    return {"__tensor__": {"dtype": str(c.dtype).removeprefix("torch."),
                           "shape": list(c.shape), "data": _b64(raw)}}


def encode(obj: Any, path: str = "state") -> Any:
    """Turns ``obj`` into JSON-compatible data; raises ConfigError naming ``path``."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {"__float__": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    torch = sys.modules.get("torch")  # a tensor subclass may be defined anywhere
    if torch is not None and isinstance(obj, (torch.Size, torch.dtype, torch.device)):
        if isinstance(obj, torch.Size):
            return {"__size__": [int(v) for v in obj]}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        return {"__device__": str(obj)}
    if isinstance(obj, (list, tuple)):
        if all(type(v) is int for v in obj):  # fast path: RNG states, index lists
            items: list[Any] = list(obj)
        else:
            items = [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{path}.{k}") for k, v in obj.items()}
        return {"__dict__": [[encode(k, f"{path}.<key>"), encode(v, f"{path}[{k!r}]")]
                             for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"__bytes__": _b64(bytes(obj))}
    mod = type(obj).__module__
    if torch is not None and isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, path)
    if mod == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                raise ConfigError(f"cannot snapshot {path}: numpy object arrays need pickle")
            c = np.ascontiguousarray(obj)  # (0-d arrays come back 1-d: keep obj.shape)
            return {"__ndarray__": {"dtype": c.dtype.str, "shape": list(obj.shape),
                                    "data": _b64(c.tobytes())}}
        if isinstance(obj, np.generic):
            return encode(obj.item(), path)
    raise ConfigError(
        f"cannot snapshot {path}: values of type {type(obj).__module__}.{type(obj).__qualname__} "
        "are not serialisable without pickle; store plain numbers/strings/lists/dicts/tensors "
        "in state_dict(), or keep this object out of `extra`")


def _decode_tensor(spec: dict[str, Any], path: str) -> Any:
    import torch

    try:
        dtype = getattr(torch, spec["dtype"])
        shape = [int(s) for s in spec["shape"]]
        raw = base64.b64decode(spec["data"], validate=True)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CorruptSnapshot(f"bad tensor encoding at {path}: {e}") from e
    if not isinstance(dtype, torch.dtype):
        raise CorruptSnapshot(f"bad tensor dtype {spec['dtype']!r} at {path}")
    if str(dtype).removeprefix("torch.") in _QUANTIZED:  # plain storage cannot hold them
        raise CorruptSnapshot(f"tensor dtype {spec['dtype']!r} at {path} is not supported")
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    if any(s < 0 for s in shape) or numel * itemsize != len(raw):
        raise CorruptSnapshot(
            f"tensor at {path}: shape {shape} of {spec['dtype']} needs {numel * itemsize} bytes, "
            f"the snapshot holds {len(raw)}")
    try:
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(
            shape).clone()
    except (RuntimeError, ValueError, TypeError) as e:
        raise CorruptSnapshot(f"tensor at {path} cannot be rebuilt: {e}") from e


def _decode_torch(tag: str, val: Any, path: str) -> Any:
    """A torch.dtype, torch.Size or torch.device (``encode``'s tags for them)."""
    import torch

    if tag == "__size__":
        if not isinstance(val, list) or not all(type(v) is int and v >= 0 for v in val):
            raise CorruptSnapshot(f"malformed __size__ value at {path}: {val!r}")
        return torch.Size(val)
    if not isinstance(val, str):
        raise CorruptSnapshot(f"malformed {tag} value at {path}: {val!r}")
    if tag == "__dtype__":
        dt = getattr(torch, val, None) if val.isidentifier() else None
        if not isinstance(dt, torch.dtype):
            raise CorruptSnapshot(f"unknown dtype {val!r} at {path}")
        return dt
    try:
        return torch.device(val)
    except (RuntimeError, ValueError) as e:
        raise CorruptSnapshot(f"malformed __device__ value at {path}: {e}") from e


def decode(obj: Any, path: str = "state") -> Any:
    """Inverse of :func:`encode`; raises CorruptSnapshot on malformed input."""
    try:
        return _decode(obj, path)
    except RecursionError as e:  # nesting json.loads accepted but decoding is deeper
        raise CorruptSnapshot(f"{path}: value nested too deeply") from e


def _decode(obj: Any, path: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        raise CorruptSnapshot(f"unexpected JSON value of type {type(obj).__name__} at {path}")
    tags = [t for t in _TAGS if t in obj]
    if not tags:
        return {k: _decode(v, f"{path}.{k}") for k, v in obj.items()}
    if len(obj) != 1:
        raise CorruptSnapshot(f"malformed tagged value at {path}: keys {sorted(obj)}")
    tag = tags[0]
    val = obj[tag]
    try:
        if tag == "__tuple__":
            return tuple(_decode(v, f"{path}[{i}]") for i, v in enumerate(val))
        if tag == "__dict__":
            return {_decode(k, f"{path}.<key>"): _decode(v, f"{path}[{k!r}]") for k, v in val}
        if tag == "__float__":
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[val]
        if tag == "__bytes__":
            return base64.b64decode(val, validate=True)
        if tag == "__tensor__":
            return _decode_tensor(val, path)
        if tag in ("__dtype__", "__size__", "__device__"):
            return _decode_torch(tag, val, path)
        import numpy as np

        raw = base64.b64decode(val["data"], validate=True)
        dt = np.dtype(val["dtype"])
        if dt.hasobject:
            raise CorruptSnapshot(f"object dtype at {path} refused")
        return np.frombuffer(raw, dtype=dt).reshape([int(s) for s in val["shape"]]).copy()
    except CorruptSnapshot:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CorruptSnapshot(f"malformed {tag} value at {path}: {e}") from e


_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode  # built once


def dumps(obj: Any, path: str = "state") -> str:
    """encode() then compact JSON text (allow_nan=False: non-finite floats are tagged)."""
    return _COMPACT(encode(obj, path))


def loads(text: str | bytes, path: str = "state") -> Any:
    """JSON text then decode(); malformed input raises CorruptSnapshot."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CorruptSnapshot(f"{path}: not valid JSON: {e}") from e
    return decode(raw, path)
