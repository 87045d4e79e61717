"""Keys a module's state_dict hook makes of a parameter, computed offline for ``cudasnap
export --to dcp`` (a loader that goes through the hook asks for them, never for the
parameter).

A view spec (recorded in the manifest's ``dcp_names["views"]`` by the Snapshotter, from
providers an integration registers with ``cudasnap.core.module_state.register_views``) is
``{"kind": ..., "names": [DCP keys, in the order the kind computes them], ...}``. Kinds:

- ``fused_qkv`` (torchtitan's ``FusedQKVLinear``): ``wqkv`` holds, per KV head, ``heads_per_kv``
  query heads, one key head and one value head of ``head_dim`` rows each; ``wq``/``wk``/``wv``
  are those rows gathered, as its ``_split_qkv_on_save`` hook makes them.
"""
from __future__ import annotations

from typing import Any

from ..errors import CorruptSnapshot


def _posint(spec: dict[str, Any], key: str, where: str) -> int:
    v = spec.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise CorruptSnapshot(f"{where}: view field {key!r} must be a positive integer, got {v!r}")
    return v


def compute(full: Any, spec: dict[str, Any], where: str) -> list[Any]:
    """The tensors of ``spec["names"]`` made of ``full`` (the whole parameter)."""
    names = spec.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CorruptSnapshot(f"{where}: view 'names' must be a list of strings")
    kind = spec.get("kind")
    if kind != "fused_qkv":
        raise CorruptSnapshot(f"{where}: unknown view kind {kind!r} (a newer cudasnap wrote it?)")
    hd, hpk = _posint(spec, "head_dim", where), _posint(spec, "heads_per_kv", where)
    r = hpk + 2
    if len(names) != 3 or full.dim() not in (1, 2) or full.shape[0] % (r * hd):
        raise CorruptSnapshot(f"{where}: a fused_qkv view of shape {list(full.shape)} with "
                              f"head_dim {hd}, heads_per_kv {hpk} and {len(names)} names")
    tail = tuple(full.shape[1:])
    w = full.reshape(full.shape[0] // (r * hd), r, hd, *tail)
    return [w[:, :hpk].reshape(-1, *tail).contiguous(), w[:, hpk].reshape(-1, *tail).contiguous(),
            w[:, hpk + 1].reshape(-1, *tail).contiguous()]
