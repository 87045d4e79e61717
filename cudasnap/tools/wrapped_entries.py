"""A snapshot's tensor-subclass state as the exports see it: one tensor per subclass value.

A snapshot holds a tensor subclass (torchao's ``OptimState8bit``; cudasnap.core.wrapped) as
its inner tensors, each an entry named ``<name>.<attr>`` with a ``wrapper`` record. The
exports want the value itself, as ``Optimizer.state_dict()`` and DCP hold it: :func:`fold`
replaces a rank's inner entries by one entry named ``<name>`` (the subclass's own dtype,
shape and shard record) whose tensor is the subclass rebuilt by its
``__tensor_unflatten__``. Its module (e.g. torchao) is imported for that: an export of a
directory the user owns, asked for by the user (a restore imports nothing by name).

Downstream, ``--to dcp`` writes that value as DCP writes one (``torch.save`` of the object:
a ``dcp.load`` into the live subclass, or into a plain tensor, reads it), ``--to torch``
keeps it (``opt.load_state_dict`` takes it back bitwise), and ``--to safetensors`` and the
assembly of shards of a subclass write its plain values (:func:`plain`).

Call order: cudasnap.tools.shards ``load_shards`` -> :func:`fold` for each rank.
"""
from __future__ import annotations

from typing import Any

from ..core import wrapped
from ..errors import SnapshotError


def fold(manifest: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
    """(manifest, tensors) of one rank with each subclass value's inner entries folded into
    one entry and its rebuilt value (the inputs unchanged when it holds none)."""
    ents = manifest["tensors"]
    if not any("wrapper" in e for e in ents):
        return manifest, tensors
    inner: dict[str, list[dict[str, Any]]] = {}
    order: list[dict[str, Any] | str] = []
    for e in ents:
        rec = e.get("wrapper")
        if rec is None:
            order.append(e)
            continue
        if rec["of"] not in inner:
            inner[rec["of"]] = []
            order.append(rec["of"])
        inner[rec["of"]].append(e)
    out_t = {k: v for k, v in tensors.items() if k not in {e["name"] for es in inner.values()
                                                           for e in es}}
    new_ents: list[dict[str, Any]] = []
    for item in order:
        if isinstance(item, dict):
            new_ents.append(item)
            continue
        es = inner[item]
        rec = es[0]["wrapper"]
        got = {e["wrapper"]["attr"]: tensors[e["name"]].clone() for e in es}
        if sorted(got) != sorted(rec["inner"]):
            raise SnapshotError(f"{item}: the snapshot holds inner tensors {sorted(got)} of its "
                                f"{rec['class']}, whose record names {rec['inner']}")
        out_t[item] = wrapped.rebuild(rec, got, "export", load=True)
        ent = {k: v for k, v in es[0].items() if k in ("group", "phase", "param_index",
                                                       "state_key", "shard")}
        ent.update(name=item, dtype=rec["dtype"], shape=list(rec["shape"]),
                   stride=list(rec["stride"]), subclass=rec["class"],
                   aliases=[a.rpartition(".")[0] for a in es[0].get("aliases", [])])
        new_ents.append(ent)
    return {**manifest, "tensors": new_ents}, out_t


def whole(ent: dict[str, Any]) -> Any:
    """The value of an assembled subclass entry held whole by one rank (unsharded: as the
    optimizer holds it), else None (a plain tensor, or shards assembled as plain values)."""
    if "subclass" not in ent or len(ent["chunks"]) != 1:
        return None
    ((_, (_, t)),) = ent["chunks"].items()
    return t if list(t.shape) == list(ent["shape"]) else None


def plain(t: Any) -> Any:
    """``t``'s values as a plain tensor (a subclass's own ``copy_`` into one: torchao's
    dequantizes); ``t`` itself when it is plain."""
    import torch

    if not wrapped.is_wrapper(t):
        return t
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out
