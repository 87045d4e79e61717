"""Training job for the multi-rank tests and bench (run under torchrun, gloo on CPU).

Env:
  CKPT          snapshot directory            OUT   results: rank-R.npz/.json (final state)
  STORE_DIR     where the per-attempt FileStores live (see init below)
  STEPS         steps to train (default 30)
  KILL_RANK, KILL_STEP, KILL_SIG (SIGKILL or SIGSTOP): that rank signals itself in the
                forward of that step, on the first attempt only (time in OUT/kill.json)
  NO_SNAP=1     no Snapshotter (the reference run)
  DUMP_STEPS=1  save the state after every step: OUT/steps/rank-R-step-S.npz
  MODE          "ddp" (default: DDP, one gradient per bucket, fixed bucket layout),
                "ddp_plain" (DDP with bucket_cap_mb only: bucket layout rebuilt after the
                first iteration, see below), "manual" (plain model + all_reduce per grad;
                MANUAL=1 is the same)
  REPLICAS      the Snapshotter's replicas= ("auto" default, "all", "none")
  FLUSH_AT=S    every rank calls snap.flush() after step S (first attempt only)
  FLUSH_AT_END=1, KEEP_ARENA=1   flush / keep the arena at the end
  WIDTH, DEPTH  model size (default 64, 0: 2.4k parameters); the bench makes it larger
Restored state right after restore_latest(): OUT/restored-rank-R.npz.
"""
import time

T_START = time.time()  # process start, before the heavy imports

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import cudasnap  # noqa: E402


class Data:
    """Per-rank batches derived from (rank, position): the state is the position alone.

    All ranks are at the same position, so a rank restored from a replica's
    files (whose host state is the replica's) continues its own data stream.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.position = 0

    def next(self):
        g = torch.Generator().manual_seed(1000 + 7919 * self.rank + self.position)
        self.position += 1
        return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


def state_arrays(core, opt):
    arrays = {k: v.detach().numpy().copy() for k, v in core.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            arrays[f"opt.{i}.{k}"] = v.detach().numpy().copy()
    return arrays


def main() -> int:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    # A fresh FileStore per restart attempt: on torchrun's shared store (kept across
    # restarts, no per-attempt prefix: pytorch#135712) an env:// group of a restarted
    # attempt reads the previous attempt's keys and fails or hangs in connectFullMesh
    # (cudasnap.distributed.kv.restarts_share_the_store). The FileStore also outlives any
    # rank, which the coordinator's store must.
    dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE_DIR']}/store-{attempt}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=__import__("datetime").timedelta(seconds=60))
    t_pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = os.environ.get("MODE", "manual" if os.environ.get("MANUAL") == "1" else "ddp")
    torch.manual_seed(0)
    width, depth = int(os.environ.get("WIDTH", "64")), int(os.environ.get("DEPTH", "0"))
    hidden = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    core = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(),
                               torch.nn.Dropout(0.1), *hidden, torch.nn.Linear(width, 4))
    if mode == "manual":
        model = core
    elif mode == "ddp":
        # Bitwise resume with DDP needs the same bucket layout in the first iteration of a
        # fresh process as in the steady state. With find_unused_parameters=False and no
        # bucket_cap_mb_list, DDP puts ALL parameters into one bucket for the first
        # iteration and rebuilds the buckets after it; the gloo ring allreduce sums each
        # element in an order that depends on its offset in the bucket, so a restarted
        # process's first step differs by ~1e-8 ("ddp_plain"). bucket_cap_mb_list fixes
        # the layout for both (here: one gradient per bucket, as in the steady state).
        model = DDP(core, bucket_cap_mb_list=[1e-6] * len(list(core.parameters())))
    elif mode == "ddp_plain":
        model = DDP(core, bucket_cap_mb=1e-6)
    else:
        raise SystemExit(f"unknown MODE {mode!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Data(rank)
    steps = int(os.environ.get("STEPS", "30"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    kill_step = int(os.environ.get("KILL_STEP", "-1"))
    kill_sig = getattr(signal, os.environ.get("KILL_SIG", "SIGKILL"))
    flush_at = int(os.environ.get("FLUSH_AT", "-1"))
    dump = os.environ.get("DUMP_STEPS") == "1"
    snap = None
    start = 0
    t0 = time.time()
    if os.environ.get("NO_SNAP") != "1":
        replicas = os.environ.get("REPLICAS", "auto")
        snap = cudasnap.Snapshotter(model, opt, directory=os.environ["CKPT"], extra={"data": data},
                                    replicas=None if replicas == "none" else replicas)
        t0 = time.time()
        start = snap.restore_latest()
        if start:
            np.savez(os.path.join(out, f"restored-rank-{rank}.npz"), **state_arrays(core, opt))
    t_restored = time.time()
    if dump:
        os.makedirs(os.path.join(out, "steps"), exist_ok=True)
    for step in range(start, steps):
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == kill_step and rank == kill_rank and attempt == 0:
            with open(os.path.join(out, "kill.json"), "w") as f:
                json.dump({"rank": rank, "step": step, "sig": kill_sig.name, "t": time.time()}, f)
            os.kill(os.getpid(), kill_sig)
        loss.backward()
        if mode == "manual":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        if snap is not None:
            snap.boundary(step)
            if step == flush_at and attempt == 0:
                snap.flush()
        if dump:
            np.savez(os.path.join(out, "steps", f"rank-{rank}-step-{step}.npz"),
                     **state_arrays(core, opt))
        time.sleep(0.02)
    np.savez(os.path.join(out, f"rank-{rank}.npz"), **state_arrays(core, opt))
    info = {"rank": rank, "pid": os.getpid(), "attempt": attempt, "start": start,
            "t_start": T_START, "t_pg": t_pg,
            "t0": t0, "t_restored": t_restored, "t_end": time.time(),
            "restore": snap.stats()["restore"] if snap else None}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(info, f)
    if snap is not None:
        if os.environ.get("FLUSH_AT_END") == "1":
            snap.flush()
        snap.close(keep_arena=os.environ.get("KEEP_ARENA") == "1")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
