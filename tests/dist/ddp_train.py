"""DDP training job for the multi-rank tests (run under torchrun, gloo on CPU).

Env: CKPT (snapshot dir), OUT (final-state dir), STEPS, KILL_RANK/KILL_STEP and
KILL_SIG (SIGKILL or SIGSTOP) applied on the first attempt only, NO_SNAP=1 for
the reference run.
"""
import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cudasnap


class Data:
    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.position = 0

    def next(self):
        self.position += 1
        return torch.randn(16, 32, generator=self.gen), torch.randn(16, 4, generator=self.gen)

    def state_dict(self):
        return {"position": self.position, "gen": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.position = sd["position"]
        self.gen.set_state(sd["gen"])


def main() -> int:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A fresh FileStore per restart: with torch 2.14.1 + gloo, re-initialising the
    # default env:// group after an elastic restart fails in connectFullMesh here.
    dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE_DIR']}/store-{attempt}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1  # the first bucket too (see below)
    core = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                    torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
    model = core if os.environ.get("MANUAL") == "1" else DDP(core,
                # One gradient per bucket: DDP rebuilds its buckets after the first
                # iteration of every process, and the ring allreduce's summation
                # order depends on a gradient's offset in its bucket; with one
                # gradient per bucket a restarted process reduces exactly as before.
                bucket_cap_mb=1e-6, static_graph=os.environ.get("STATIC") == "1",
                gradient_as_bucket_view=os.environ.get("GABV") == "1")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Data(rank)
    steps = int(os.environ.get("STEPS", "30"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    kill_step = int(os.environ.get("KILL_STEP", "-1"))
    kill_sig = getattr(signal, os.environ.get("KILL_SIG", "SIGKILL"))
    snap = None
    start = 0
    t0 = time.time()
    if os.environ.get("NO_SNAP") != "1":
        snap = cudasnap.Snapshotter(model, opt, directory=os.environ["CKPT"], extra={"data": data})
        start = snap.restore_latest()
    t_restored = time.time()
    for step in range(start, steps):
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == kill_step and rank == kill_rank and attempt == 0:
            os.kill(os.getpid(), kill_sig)
        loss.backward()
        if os.environ.get("MANUAL") == "1":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        if snap is not None:
            snap.boundary(step)
        time.sleep(0.02)
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    arrays = {k: v.detach().numpy().copy() for k, v in core.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            arrays[f"opt.{i}.{k}"] = v.detach().numpy().copy()
    np.savez(os.path.join(out, f"rank-{rank}.npz"), **arrays)
    info = {"rank": rank, "attempt": attempt, "start": start, "t0": t0, "t_restored": t_restored,
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
