"""Offline assembly of every layout torchtitan makes (issue 45 item 2), fast:

- ``_StridedShard`` and mixed placements (TP alone, FSDP2 + TP, a strided shard on a size-1
  dp dim, uneven sizes, empty shards, replicas) laid out by DTensor itself: each rank's local
  shard comes from ``distribute_tensor`` on a ``fake`` process group of that rank (DTensor's
  own ``_split_tensor``, no collective), its ``shard`` record from ``cudasnap.core.sharded``;
  the assembly equals the tensor and every DCP chunk is a box of it;
- pipeline stages (each rank its own parameters, optimizer state under per-rank indices)
  matched by parameter FQN: ``--to dcp`` writes the keys torchtitan's CheckpointManager asks
  for, ``--to torch`` one state_dict, optimizer state merged by FQN;
- what stays unsupported (``Partial``) and damaged records are refused naming the tensor."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import parts

from cudasnap.errors import ConfigError, SnapshotError
from cudasnap.format import codec
from cudasnap.tools import shards
from cudasnap.tools.shards import local_indices


def _layout(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: list[Any]
            ) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Per rank: (its cudasnap shard record, its local shard) as DTensor lays ``full`` out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cudasnap.core.sharded import shard_info

    out = []
    world = 1
    for n in mesh_shape:
        world *= n
    for r in range(world):
        dist.init_process_group("fake", rank=r, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", mesh_shape,
                                    mesh_dim_names=tuple(f"d{i}" for i in range(len(mesh_shape))))
            dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
            out.append((shard_info(dt), dt.to_local().clone()))
        finally:
            dist.destroy_process_group()
    return out


def _ranks(name: str, per_rank: list[tuple[dict[str, Any], torch.Tensor]], group: str = "model:model"
           ) -> list[dict[str, Any]]:
    return [{"rank": r, "manifest": {"tensors": [
        {"name": name, "group": group, "dtype": str(t.dtype).removeprefix("torch."),
         "shape": list(t.shape), "shard": info}]}, "tensors": {name: t}}
        for r, (info, t) in enumerate(per_rank)]


def _placements(text: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in text.split():
        kind, _, arg = p.partition(":")
        out.append(Replicate() if kind == "R" else Shard(int(arg)) if kind == "S" else
                   _StridedShard(int(arg.split(",")[0]), split_factor=int(arg.split(",")[1])))
    return out


CASES = [  # mesh, placements (S:d Shard(d), SS:d,k _StridedShard(d, sf=k), R), global shape
    ((2,), "S:0", (5, 3)),  # FSDP2, uneven
    ((1, 2), "SS:0,2 S:0", (8, 4)),  # torchtitan TP: a strided shard on a size-1 dp dim
    ((1, 2), "S:0 S:1", (6, 7)),  # torchtitan TP rowwise, uneven
    ((2, 2), "SS:0,2 S:0", (8, 3)),  # FSDP2 + TP
    ((2, 2), "SS:0,2 S:0", (7, 5)),  # ... uneven
    ((2, 2), "SS:0,2 S:0", (3, 2)),  # ... shards left empty
    ((2, 2), "S:0 S:1", (5, 7)),
    ((2, 2), "SS:1,2 S:1", (4, 9)),
    ((2, 2), "S:0 R", (5, 2)),  # replicas read once
    ((2, 2), "R SS:0,2", (9, 2)),
    ((4,), "SS:0,3", (10,)),
    ((2, 1, 2), "SS:0,2 R S:0", (11, 3)),
    ((2, 2), "SS:0,2 S:1", (6, 5)),
]


@pytest.mark.parametrize("mesh, text, shape", CASES, ids=[f"{m}-{t}-{s}" for m, t, s in CASES])
def test_offline_assembly_matches_dtensors_own_layout(mesh, text, shape) -> None:
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    per_rank = _layout(full, mesh, _placements(text))
    for info, t in per_rank:  # the rank's indices pick its own bytes out of the tensor
        idx = [[g + i for g, n in runs for i in range(n)] for runs in
               local_indices("w", info, list(t.shape))]
        picked = full
        for d, ix in enumerate(idx):
            picked = picked.index_select(d, torch.tensor(ix, dtype=torch.long))
        assert torch.equal(picked, t), (info, t)
    ent = parts.shards_chunks(_ranks("model.w", per_rank), maps={})["model.w"]
    assert torch.equal(parts.shards_assemble("model.w", ent), full)
    covered = 0
    for off, (_, t) in ent["chunks"].items():  # each DCP chunk is a box of the tensor
        assert torch.equal(full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))], t)
        covered += t.numel()
    assert covered == full.numel()


def test_export_dcp_of_strided_shards_loads_back_whole(tmp_path: Path, monkeypatch) -> None:
    """``--to dcp`` of FSDP2 + TP shards (uneven): DCP's own reader gives the tensor back."""
    import torch.distributed.checkpoint as dcp

    from cudasnap.tools.export_dcp import export_dcp

    full = torch.randn(7, 5)
    ranks = _ranks("model.w", _layout(full, (2, 2), _placements("SS:0,2 S:0")))
    for r in ranks:
        r["manifest"].update(host=codec.encode({"step": 3}, "host"), world_size=4, step=3)
    monkeypatch.setattr(shards, "load_shards", lambda d, s=None: (3, ranks))
    export_dcp(tmp_path / "snap", tmp_path / "out")
    got = {"model.w": torch.zeros(7, 5)}
    dcp.load(got, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(got["model.w"], full)


# --------------------------------------------------------------- pipeline stages by FQN
def _stage_rank(rank: int, parts: dict[str, list[tuple[str, list[int]]]],
                step: int = 6) -> dict[str, Any]:
    """A rank of a torchtitan PP snapshot: models ``model.<i>``, optimizers ``optim.<i>``
    (Adam-like moments under per-rank parameter indices), as the integration records them."""
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict[str, Any]] = []
    fqns: dict[str, list[str]] = {}
    optim: dict[str, Any] = {}
    for i, (part, params) in enumerate(sorted(parts.items())):
        okey = f"optim.{i}"
        fqns[okey] = [f"{part}.{n}" for n, _ in params]
        for pi, (n, shape) in enumerate(params):
            seed = sum(map(ord, n))
            w = torch.arange(seed, seed + torch.Size(shape).numel(), dtype=torch.float32)
            for name, group, t, extra in (
                    (f"{part}.{n}", f"model:{part}", w.reshape(shape), {}),
                    (f"{okey}.state.{pi}.exp_avg", f"optim:{okey}", -w.reshape(shape),
                     {"param_index": pi, "state_key": "exp_avg"}),
                    (f"{okey}.state.{pi}.step", f"optim:{okey}", torch.tensor(float(step)),
                     {"param_index": pi, "state_key": "step"})):
                tensors[name] = t
                entries.append({"name": name, "group": group, "dtype": "float32",
                                "shape": list(t.shape), "unknown_field": 1, **extra})
        optim[okey] = {"class": "AdamW", "scalars": [], "param_groups": [
            {"lr": 0.1, "param_names": [n for n, _ in params], "params": [0, len(params)]}]}
    host = {"step": step, "optim": optim, "rng": {}, "extra": {
        "lr_scheduler": {"kind": "state_dict", "class": "LRSchedulersContainer",
                         "state": {"last_epoch": step}},
        "dataloader": {"kind": "state_dict", "state": {"dp_rank_0": b"pos", "world_size": 1}}}}
    return {"rank": rank, "tensors": tensors, "manifest": {
        "rank": rank, "world_size": 2, "step": step, "format_version": 1, "tensors": entries,
        "host": codec.encode(host, "host"), "dcp_names": {"model": {}, "optim": fqns}}}


STAGES = [  # two stages per rank (interleaved), different parameters everywhere
    _stage_rank(0, {"model.0": [("tok.weight", [6, 4]), ("layers.0.w", [4, 4])],
                    "model.1": [("layers.3.w", [4, 4])]}),
    _stage_rank(1, {"model.0": [("layers.1.w", [4, 4]), ("layers.2.w", [4, 2])],
                    "model.1": [("norm.weight", [4]), ("out.weight", [5, 4])]}),
]


def test_pipeline_stages_are_matched_by_fqn_not_by_index(tmp_path: Path, monkeypatch) -> None:
    """The ranks' ``optim.0.state.0.exp_avg`` are different parameters: the export holds each
    under torchtitan's key of its own FQN (the index keys of the merged order beside)."""
    import torch.distributed.checkpoint as dcp

    from cudasnap.tools.export import export_dcp, export_torch

    monkeypatch.setattr(shards, "load_shards", lambda d, s=None: (6, STAGES))
    export_dcp(tmp_path / "snap", tmp_path / "dcp")
    want: dict[str, torch.Tensor] = {}
    for r in STAGES:
        for e in r["manifest"]["tensors"]:
            t = r["tensors"][e["name"]]
            if e["group"].startswith("model:"):
                want[e["name"].split(".", 2)[2]] = t  # torchtitan: top-level FQN
            else:
                okey = e["group"].partition(":")[2]
                fqn = r["manifest"]["dcp_names"]["optim"][okey][e["param_index"]]
                want[f"optimizer.state.{fqn.split('.', 2)[2]}.{e['state_key']}"] = t
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    got.update({"optimizer.param_groups.out.weight.lr": 0.0, "lr_scheduler.last_epoch": 0,
                "train_state.step": torch.tensor(0, dtype=torch.int32)})
    dcp.load(got, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert got["optimizer.param_groups.out.weight.lr"] == 0.1
    assert got["lr_scheduler.last_epoch"] == 6 and int(got["train_state.step"]) == 6

    export_torch(tmp_path / "snap", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    model = {k: v for k, v in want.items() if not k.startswith("optimizer.")}
    assert full["model"].keys() == model.keys()  # the stages as one state_dict
    assert all(torch.equal(full["model"][k], v) for k, v in model.items())
    for okey, o in full["optimizer"].items():  # per optimizer key, merged over the ranks
        (g,) = o["param_groups"]
        assert g["params"] == sorted(o["state"]) == list(range(len(g["param_names"])))
        for i, n in zip(g["params"], g["param_names"]):
            assert torch.equal(o["state"][i]["exp_avg"], -model[n]), (okey, n)
    assert full["optimizer"]["optim.0"]["param_groups"][0]["param_names"] == [
        "tok.weight", "layers.0.w", "layers.1.w", "layers.2.w"]


def test_unmatched_stage_parameters_are_refused_naming_the_optimizer(monkeypatch) -> None:
    ranks = json.loads(json.dumps([{k: v for k, v in r.items() if k != "tensors"}
                                   for r in STAGES]))
    for r, src in zip(ranks, STAGES):
        r["tensors"] = src["tensors"]
    ranks[1]["manifest"]["dcp_names"]["optim"]["optim.0"][1] = None
    with pytest.raises(ConfigError, match=r"optimizer 'optim.0' holds different parameters "
                                          r"on different ranks .* cannot be matched"):
        parts.shards_chunks(ranks)


# ------------------------------------------------------------------- refusals
def test_partial_and_unknown_placements_are_refused_naming_the_tensor() -> None:
    info = {"global_shape": [4], "mesh_shape": [2], "mesh_dims": ["tp"], "coord": [0],
            "offset": [0]}
    for p, why in (("Partial(sum)", "partial value still to be reduced across ranks"),
                   ("Blocked(dim=0)", "a placement this cudasnap does not know")):
        ranks = _ranks("optim.state.0.exp_avg", [({**info, "placements": [p]}, torch.ones(4))])
        with pytest.raises(ConfigError, match=rf"optim.state.0.exp_avg: placement "
                                              rf"{p.replace('(', '.').replace(')', '.')} "
                                              rf"cannot be exported offline: .*{why}"):
            parts.shards_chunks(ranks, maps={})


def test_a_shard_that_is_not_what_its_placements_say_is_refused() -> None:
    full = torch.arange(14.0).reshape(7, 2)
    per_rank = _layout(full, (2, 2), _placements("SS:0,2 S:0"))
    bad = [(i, t) for i, t in per_rank]
    bad[3] = (bad[3][0], torch.zeros(2, 2))  # rank 3 holds 1 row, says 2
    with pytest.raises(SnapshotError, match=r"model.w: a local shard of shape \[2, 2\] where "
                                            r"placements \[_StridedShard\(dim=0, sf=2\), "
                                            r"Shard\(0\)\] on mesh \[2, 2\] at coordinate "
                                            r"\[1, 1\] of global shape \[7, 2\] give \[1, 2\]"):
        parts.shards_chunks(_ranks("model.w", bad), maps={})
    missing = _ranks("model.w", per_rank[:3])  # rank 3's files absent: a hole
    with pytest.raises(SnapshotError, match=r"model.w: the ranks' shards cover 12 of 14"):
        parts.shards_chunks(missing, maps={})
    twice = _ranks("model.w", per_rank)
    twice[2]["manifest"]["tensors"][0]["shard"] = {**per_rank[0][0], "coord": [1, 0],
                                                    "placements": ["Shard(0)", "Replicate()"]}
    twice[2]["tensors"]["model.w"] = torch.zeros(3, 2)
    with pytest.raises(SnapshotError, match="model.w: the ranks' shards"):
        parts.shards_chunks(twice, maps={})
