"""Plain values as snapshot state: ``extra`` tensors and containers, ``boundary(**values)``.

Two short ways to keep state that lives outside model and optimizer (a prefetched
batch, a best-loss float, a dict of counters), besides objects with
``state_dict()``/``load_state_dict()`` (DCP's ``Stateful`` protocol)::

    snap = cudasnap.Snapshotter(model, opt, extra={"counters": counters})  # a dict/list/tensor:
    start = snap.restore_latest()                 # ...put back in place by the restore
    X, best = snap.values.get("X", X), snap.values.get("best", best)
    for step in range(start, steps):
        ...
        snap.boundary(step, X=X, best=best)       # any JSON-able value or tensor, per step

Values go through the typed JSON codec (cudasnap.format.codec): no pickle, tensors
inline up to its size limit and come back on the CPU.
"""
from __future__ import annotations

from ..errors import ConfigError, IncompatibleSnapshot
from ..format import codec


def accepts(key: str, obj: object) -> bool:
    """True for a tensor, dict or list ``extra`` value (restored in place); ConfigError for
    an immutable plain value, which a restore could not give back to the caller."""
    import torch

    if isinstance(obj, torch.Tensor):
        why = codec.host_tensor_refusal(obj)  # refused now, not at the first boundary
        if why is not None:
            raise ConfigError(f"extra[{key!r}] {why}")
        return True
    if isinstance(obj, (dict, list)):
        return True
    if obj is None or isinstance(obj, (int, float, str, bool, tuple)):
        raise ConfigError(
            f"extra[{key!r}] is an immutable {type(obj).__name__}: a restore cannot change it "
            f"in place; pass it per step instead: snap.boundary(step, {key}=value), and read "
            f"it back from snap.values[{key!r}] after restore_latest()")
    return False


def restore_into(obj: object, value: object, key: str, where: str) -> None:
    """Puts a restored ``extra`` value back into the live object, in place."""
    import torch

    if isinstance(obj, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != obj.shape:
            raise IncompatibleSnapshot(
                f"{where}: extra[{key!r}] is a tensor of shape {list(obj.shape)} here, "
                f"{list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                " in the snapshot")
        with torch.no_grad():
            obj.copy_(value)
    elif isinstance(obj, dict) and isinstance(value, dict):
        obj.clear()
        obj.update(value)
    elif isinstance(obj, list) and isinstance(value, list):
        obj[:] = value
    else:
        raise IncompatibleSnapshot(f"{where}: extra[{key!r}] is a {type(obj).__name__} here, "
                                   f"a {type(value).__name__} in the snapshot")
