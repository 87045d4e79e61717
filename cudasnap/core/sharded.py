"""Sharded state: DTensor parameters and optimizer state (FSDP2, tensor parallel, HSDP).

A DTensor is a wrapper subclass: its bytes live in its local shard
(``_local_tensor``, what ``to_local()`` returns), never behind the wrapper's own
``data_ptr``. A snapshot copies each rank's local shard like any plain tensor
and records, per tensor, where that shard sits in the global tensor::

    "shard": {"global_shape": [5, 8], "mesh_shape": [2], "mesh_dims": ["dp"],
              "placements": ["Shard(0)"], "coord": [1], "offset": [3, 0]}

(the local shape is the entry's own ``shape``; FSDP2's uneven last shards, even
empty ones, are recorded as they are, without padding). Restore puts bytes back
into the live local shards when the live mesh and placements are the recorded
ones, and raises IncompatibleSnapshot naming both meshes otherwise; a different
mesh goes through ``cudasnap export --to dcp`` (cudasnap.tools.export).

Nothing here imports ``torch.distributed.tensor`` unless a DTensor exists.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

from ..errors import IncompatibleSnapshot

if TYPE_CHECKING:  # type-only: torch.distributed.tensor is imported once a DTensor exists
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement
    from typing_extensions import TypeIs

    from ..format.manifest import TensorEntry

# JSON-like (the manifest's "shard" record): global_shape, mesh_shape, mesh_dims,
# placements, coord, offset.
ShardInfo = dict[str, object]


def _dtensor_cls() -> type[DTensor] | None:
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: object) -> TypeIs[DTensor]:
    """True for a torch.distributed.tensor.DTensor (its module was imported to make one)."""
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local_shard(t: DTensor) -> torch.Tensor:
    """The plain tensor holding this rank's bytes of DTensor ``t`` (same object every call)."""
    return t._local_tensor


def placement_name(p: Placement) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``; other kinds by their repr."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(p) is Shard:
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return repr(p)  # e.g. _StridedShard(dim=0, sf=2): restore compares it as text


def shard_info(t: DTensor) -> ShardInfo:
    """Where DTensor ``t``'s local shard lies in the global tensor, on which mesh."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    coord = mesh.get_coordinate()
    return {"global_shape": [int(s) for s in t.shape],
            "mesh_shape": [int(s) for s in mesh.mesh.shape],
            "mesh_dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "placements": [placement_name(p) for p in t.placements],
            "coord": [int(c) for c in coord] if coord is not None else None,
            "offset": [int(o) for o in offset]}


def describe(info: ShardInfo | None) -> str:
    """One line naming a mesh and placements, for error messages."""
    if not info:
        return "no device mesh (a plain tensor)"
    dims = cast("list[str] | None", info.get("mesh_dims"))
    names = f" dims {tuple(dims)}" if dims else ""
    mesh, placements = cast("list[int]", info["mesh_shape"]), cast("list[str]", info["placements"])
    return (f"mesh {tuple(mesh)}{names} placements "
            f"[{', '.join(placements)}] global shape {list(cast('list[int]', info['global_shape']))}")


# Not "coord": an HSDP replica holds the same shard at another replicate-dim coordinate.
_SAME_KEYS = ("global_shape", "mesh_shape", "mesh_dims", "placements", "offset")


def check_same(name: str, saved: ShardInfo | None, live: ShardInfo | None, where: str) -> None:
    """IncompatibleSnapshot naming both meshes unless the live shard is the saved one."""
    if not saved and not live:
        return
    if saved and live and all(saved.get(k) == live.get(k) for k in _SAME_KEYS):
        return
    raise IncompatibleSnapshot(
        f"{where}: {name!r} was saved on {describe(saved)} (rank coordinate "
        f"{(saved or {}).get('coord')}, offset {(saved or {}).get('offset')}) but lives here on "
        f"{describe(live)} (coordinate {(live or {}).get('coord')}, offset "
        f"{(live or {}).get('offset')}); restore on the same mesh, or export it with "
        "`cudasnap export DIR --to dcp OUT` and load that with cudasnap.load_resharded()")


def like_param(value: torch.Tensor, entry: TensorEntry, param: torch.Tensor,
               where: str) -> torch.Tensor:
    """An optimizer state value read from a snapshot, as the live optimizer holds it.

    ``value`` is the plain local shard; when the parameter is a DTensor the
    value becomes a DTensor on the parameter's mesh and placements (after
    checking that they are the recorded ones).
    """
    saved = entry.get("shard")
    if not is_dtensor(param):
        if saved:
            check_same(entry["name"], saved, None, where)
        return value
    live = shard_info(param)
    if not saved:
        if list(value.shape) == []:  # a scalar next to a sharded parameter (Adam's step)
            return value
        check_same(entry["name"], None, live, where)
    check_same(entry["name"], saved, live, where)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def replica_groups(tensors: list[DTensor], world: int) -> list[list[int]] | None:
    """Ranks holding identical state, from the DTensors' meshes (HSDP: the replicate dim).

    ``tensors``: the live DTensors. A mesh dimension along which EVERY DTensor is
    ``Replicate()`` makes the ranks differing only in that coordinate replicas (a lost
    rank's shard is then loaded from a replica's files). None: no DTensor, meshes differ,
    a mesh does not span the world, or no dimension is replicated throughout.
    """
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors}
    if len(meshes) != 1:
        return None
    mesh = next(iter(meshes.values()))
    ranks = mesh.mesh
    if ranks.numel() != world:
        return None
    from torch.distributed.tensor import Replicate

    rep = [d for d in range(ranks.dim())
           if all(isinstance(t.placements[d], Replicate) for t in tensors)]
    if not rep:
        return None
    keep = [d for d in range(ranks.dim()) if d not in rep]
    n_rep = 1
    for d in rep:
        n_rep *= int(ranks.shape[d])
    groups = ranks.permute(*keep, *rep).reshape(-1, n_rep)
    return sorted(sorted(int(r) for r in g) for g in groups.tolist())
