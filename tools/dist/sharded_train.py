"""Sharded training job for tests/distributed/test_sharded_dist.py (torchrun, gloo on CPU).

MODE: "fsdp" (FSDP2 ``fully_shard`` on a 1-D mesh of every rank), "tp" (tensor
parallel: colwise + rowwise Linear pair), "hsdp" (FSDP2 on a 2-D (replicate,
shard) mesh, 2 x WORLD/2).
Env as tools/dist/ddp_train.py: CKPT, OUT, STORE_DIR, STEPS, KILL_RANK, KILL_STEP,
NO_SNAP=1, DUMP_STEPS=1. Results: OUT/rank-R.npz holds the gathered FULL state
(parameters and optimizer state, ``full_tensor()``), OUT/rank-R.json the restore
info; OUT/restored-rank-R.npz the full state right after restore_latest().
FLUSH_AT_END=1: every rank flushes (a coordinated, committed snapshot) before close.
WIDTH=W: hidden sizes W (default 13 and 7: uneven shards); the bench makes it larger.
DCP_ASYNC=1 (with NO_SNAP=1): torch.distributed.checkpoint.async_save of the same
state after every step instead of a snapshot (bench/distributed.py --fsdp).
Per rank OUT/rank-R.json also holds block_ms (median time the loop was blocked
per step by boundary() or async_save) and t_start / t_restored.
LOAD_DCP=D: start from ``cudasnap.load_resharded(D, ...)`` (a ``cudasnap export --to dcp``
checkpoint of any mesh) instead of a snapshot; with NO_SNAP=1. LOAD_API=dsd: load it as
torchtitan does instead (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``; the step
from ``train_state.step``).

Determinism: FSDP2's reduce-scatter and all-gather on gloo are bitwise stable for
a fixed world size and module layout; nothing needed setting (unlike DDP's buckets).
"""
import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import cudasnap  # noqa: E402
from tools.dist.sharded_worker import full_state  # noqa: E402  (PYTHONPATH: the repo)


class Data:
    """Batches derived from (data-parallel rank, position)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.position = 0

    def next(self):
        g = torch.Generator().manual_seed(1000 + 7919 * self.dp_rank + self.position)
        self.position += 1
        return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


def build(mode: str, world: int):
    torch.manual_seed(0)
    # Odd sizes: FSDP2 shards dim 0 unevenly (the last ranks hold fewer rows, or none).
    w = int(os.environ.get("WIDTH", "0"))
    h1, h2 = (w, w) if w else (13, 7)
    model = torch.nn.Sequential(torch.nn.Linear(16, h1), torch.nn.Tanh(),
                                torch.nn.Linear(h1, h2), torch.nn.Tanh(), torch.nn.Linear(h2, 4))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dist.get_rank()
    if mode == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dist.get_rank()
    if mode == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model = torch.nn.Sequential(torch.nn.Linear(16, 14), torch.nn.Tanh(),
                                    torch.nn.Linear(14, 4))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model, 0  # every TP rank sees the same batch
    raise SystemExit(f"unknown MODE {mode!r}")


def main() -> int:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE_DIR']}/store-{attempt}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, dp_rank = build(os.environ.get("MODE", "fsdp"), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Data(dp_rank)
    steps = int(os.environ.get("STEPS", "12"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    kill_step = int(os.environ.get("KILL_STEP", "-1"))
    snap = None
    start = 0
    if os.environ.get("LOAD_DCP"):
        if os.environ.get("LOAD_API") == "dsd":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd, "train_state": {"step": torch.tensor(0, dtype=torch.int32)}}
            dcp.load(sd, checkpoint_id=os.environ["LOAD_DCP"])
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = int(sd["train_state"]["step"]) + 1
        else:
            start = cudasnap.load_resharded(os.environ["LOAD_DCP"], model, opt)
        data.position = start  # the data position is per rank: not carried over
        np.savez(os.path.join(out, f"restored-rank-{rank}.npz"), **full_state(model, opt))
    if os.environ.get("NO_SNAP") != "1":
        snap = cudasnap.Snapshotter(model, opt, directory=os.environ["CKPT"], extra={"data": data})
        start = snap.restore_latest()
        if start:
            np.savez(os.path.join(out, f"restored-rank-{rank}.npz"), **full_state(model, opt))
    if os.environ.get("DUMP_STEPS") == "1":
        os.makedirs(os.path.join(out, "steps"), exist_ok=True)
    t_restored = time.time()
    blocked: list[float] = []
    fut = None
    # async_save's collectives run on a background thread: on the training's own gloo
    # group they interleave with FSDP's all-gathers (gloo aborts). Its own group, as DCP asks.
    dcp_pg = dist.new_group(backend="gloo") if os.environ.get("DCP_ASYNC") == "1" else None
    for step in range(start, steps):
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == kill_step and rank == kill_rank and attempt == 0:
            with open(os.path.join(out, "kill.json"), "w") as f:
                json.dump({"rank": rank, "step": step, "t": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if snap is not None:
            snap.boundary(step)
        elif os.environ.get("DCP_ASYNC") == "1":
            import torch.distributed.checkpoint as dcp

            if fut is not None:
                fut.result()  # one save in flight, as the snapshot's copy
            fut = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                 checkpoint_id=os.path.join(out, f"dcp-{step % 2}"),
                                 process_group=dcp_pg)
        blocked.append(time.perf_counter() - t0)
        if os.environ.get("DUMP_STEPS") == "1":
            np.savez(os.path.join(out, "steps", f"rank-{rank}-step-{step}.npz"),
                     **full_state(model, opt))
        time.sleep(0.02)
    if fut is not None:
        fut.result()
    np.savez(os.path.join(out, f"rank-{rank}.npz"), **full_state(model, opt))
    info = {"rank": rank, "attempt": attempt, "start": start, "t_start": T_START,
            "t_restored": t_restored,
            "block_ms": float(np.median(blocked[1:] or blocked or [0.0])) * 1e3,
            # the optimizer step's wait for a running copy (fence), per step
            "fence_ms": snap.stats()["fence_wait_s"] * 1e3 / max(1, steps - start) if snap else 0.0,
            "restore": snap.stats()["restore"] if snap else None}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(info, f)
    if snap is not None:
        if os.environ.get("FLUSH_AT_END") == "1":
            snap.flush()
        snap.close()
    # Every rank's gloo work is over before any rank tears its group down: a rank of the
    # 3-rank DCP-load run (no cudasnap in it) aborted in teardown once under a CI's load
    # ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
