"""In-process 2-rank scenarios for sharded (DTensor) state: FSDP2 and tensor parallel on a
CPU mesh (torch.multiprocessing spawn + gloo). Each rank writes BASE/<scenario>-rank-R.json;
full (gathered) states go to BASE/<scenario>-<what>-rank-R.npz."""
from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tools.dist.spawn_worker import _pg
from tools.dist.fused import FusedQKV


def build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same module tree (names) for both kinds: FSDP2 (13 hidden: uneven shards) or TP
    (14 hidden: DTensor's rowwise matmul needs even shards). ``fused``: FSDP2 over a model
    whose state_dict is not its parameters (tools.dist.fused.FusedQKV)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    if kind == "fused":
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Sequential(FusedQKV(), torch.nn.Linear(6, 4))
        model.register_buffer("seen", torch.zeros(3))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    h = 13 if kind == "fsdp" else 14
    model = torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.Tanh(), torch.nn.Linear(h, 4))
    model.register_buffer("seen", torch.zeros(3))  # plain state beside the DTensors
    world = dist.get_world_size()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> np.ndarray:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    out = {f"m.{k}": full(v) for k, v in model.state_dict().items()}
    out.update((f"p.{n}", full(p)) for n, p in model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"o.{names[id(p)]}.{k}"] = full(v)
    return out


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, snap: Any) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * (dist.get_rank() if snap.kind != "tp" else 0)
                                          + step)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.seen += 1
        snap.boundary(step)
    snap.wait()


def _snap(model: Any, opt: Any, base: Path, name: str, kind: str) -> Any:
    import cudasnap

    snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=f"{base.name}-{name}",
                                health=False)
    snap.kind = kind
    return snap


def save_rollback_restore(base: Path, rank: int, world: int, kind: str) -> dict[str, Any]:
    """Train 4 steps, flush (step 3), train 2 more, rollback (step 5); then a new model,
    optimizer and Snapshotter restore step 5 from shared memory and step 3 from disk."""
    name = f"{kind}_save"
    _pg(base, name, rank, world)
    model, opt = build(kind)
    snap = _snap(model, opt, base, name, kind)
    train(model, opt, range(4), snap)
    res: dict[str, Any] = {"flushed": str(snap.flush())}
    np.savez(base / f"{name}-step3-rank-{rank}.npz", **full_state(model, opt))
    train(model, opt, range(4, 6), snap)
    np.savez(base / f"{name}-step5-rank-{rank}.npz", **full_state(model, opt))
    train(model, opt, range(6, 8), snap)
    res["rollback"] = snap.rollback()  # newest COMPLETE slot: step 7
    np.savez(base / f"{name}-rollback-rank-{rank}.npz", **full_state(model, opt))
    np.savez(base / f"{name}-step7-rank-{rank}.npz", **full_state(model, opt))
    snap.close(keep_arena=True)
    dist.barrier()
    # A new job: fresh objects (optimizer state not yet created), arena left in /dev/shm.
    model, opt = build(kind)
    snap = _snap(model, opt, base, name, kind)
    res["start_shm"] = snap.restore_latest()
    res["source_shm"] = snap.stats()["restore"]["source"]
    np.savez(base / f"{name}-restored_shm-rank-{rank}.npz", **full_state(model, opt))
    train(model, opt, range(res["start_shm"], res["start_shm"] + 1), snap)  # training goes on
    snap.close(keep_arena=False)  # removes the arena: the next one restores from disk
    dist.barrier()
    model, opt = build(kind)
    snap = _snap(model, opt, base, name, kind)
    res["start_disk"] = snap.restore_latest()
    res["source_disk"] = snap.stats()["restore"]["source"]
    np.savez(base / f"{name}-restored_disk-rank-{rank}.npz", **full_state(model, opt))
    snap.close()
    dist.barrier()
    dist.destroy_process_group()
    return res


def mismatch(base: Path, rank: int, world: int) -> dict[str, Any]:
    """The FSDP2 snapshot restored into the tensor-parallel model: IncompatibleSnapshot."""
    _pg(base, "mismatch", rank, world)
    model, opt = build("tp")
    import cudasnap

    snap = cudasnap.Snapshotter(model, opt, directory=base / "fsdp_save",
                                job=f"{base.name}-mismatch", health=False)
    res: dict[str, Any] = {}
    try:
        res["start"] = snap.restore_latest()
    except cudasnap.IncompatibleSnapshot as e:
        res["error"] = str(e)
    snap.close()
    dist.barrier()
    dist.destroy_process_group()
    return res


def worker(rank: int, world: int, base_s: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.pop("CUDASNAP_HEALTH", None)
    base = Path(base_s)
    for sc in scenarios:
        try:
            if sc in ("fsdp", "tp", "fused"):
                res = save_rollback_restore(base, rank, world, sc)
            elif sc == "mismatch":
                res = mismatch(base, rank, world)
            else:
                raise ValueError(sc)
        except Exception:  # noqa: BLE001 - reported to the test
            res = {"crash": traceback.format_exc()}
        (base / f"{sc}-rank-{rank}.json").write_text(json.dumps(res))
