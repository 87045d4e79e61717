"""One process of an in-process-restart job (cudasnap.distributed.inprocess), launched by
tools/stacks/inprocess_harness.py (tests/distributed/test_inprocess.py, bench/recovery.py).

Env: CUDASNAP_CONTROL / CUDASNAP_UID / CUDASNAP_WORLD / CUDASNAP_NPROC (the membership), CKPT
(snapshot directory), CUDASNAP_JOB, OUT, STEPS, REF=1 (no cudasnap: plain gloo over env://,
the uninterrupted reference), CLASSIC=1 (cudasnap without in-process restart, under
``cudasnap run -- torchrun``: every process starts again after a loss). A data-parallel
MLP: gradients all-reduced by hand, AdamW, the batch of each step drawn from (step, rank).
Prints ``[ip] uid=U pid=P gen=G rank=R start=S`` when an attempt starts and
``[ip] uid=U rank=R step=S t=<time>`` after each step; at the end, rank R writes
OUT/rank-R.pt: parameters, optimizer state, the pids it ran as, its uid.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def train_step(m: torch.nn.Module, o: torch.optim.Optimizer, step: int, rank: int,
               world: int, attempt: object = None) -> None:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    m(torch.randn(16, 64, generator=g)).square().mean().backward()
    for p in m.parameters():
        assert p.grad is not None
        if attempt is None:
            dist.all_reduce(p.grad)
        else:  # left as soon as a peer is lost (Attempt.wait)
            attempt.wait(dist.all_reduce(p.grad, async_op=True))  # type: ignore[attr-defined]
        p.grad /= world
    o.step()
    o.zero_grad(set_to_none=True)


def dump(m: torch.nn.Module, o: torch.optim.Optimizer, rank: int, extra: dict) -> None:
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"p.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for i, st in enumerate(o.state.values()):
        for k, v in st.items():
            tensors[f"o{i}.{k}"] = torch.as_tensor(v).clone()
    torch.save({"tensors": tensors, **extra}, out / f"rank-{rank}.pt")


CKPT = os.environ.get("CKPT") or os.environ.get("CUDASNAP_DIR", "ckpt")


def main() -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, file=sys.stdout)  # where a hung process is
    torch.set_num_threads(1)
    steps = int(os.environ.get("STEPS", "40"))
    uid = int(os.environ.get("CUDASNAP_UID") or os.environ.get("RANK", "0"))
    m, o = build()  # a spare builds its model before it waits: warm
    if os.environ.get("REF"):
        dist.init_process_group("gloo")
        r, w = dist.get_rank(), dist.get_world_size()
        for step in range(steps):
            train_step(m, o, step, r, w)
        dump(m, o, r, {"pids": [os.getpid()], "uid": uid})
        dist.destroy_process_group()
        return 0
    import cudasnap

    if os.environ.get("CLASSIC"):  # today's way: one process per rank per attempt (torchrun)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        snap = cudasnap.Snapshotter(m, o, directory=CKPT, health=False)
        start = snap.restore_latest()
        src = (snap.stats().get("restore") or {}).get("source")
        print(f"[ip] uid={rank} pid={os.getpid()} gen={os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
              f" rank={rank} start={start + 1} src={src}", flush=True)
        for step in range(start, steps):
            train_step(m, o, step, rank, world)
            snap.boundary(step)
            print(f"[ip] uid={rank} rank={rank} step={step + 1} t={time.time():.3f}", flush=True)
            time.sleep(0.02)
        snap.flush()
        snap.close()
        dump(m, o, rank, {"pids": [os.getpid()], "uid": rank})
        dist.destroy_process_group()
        return 0
    pids: list[int] = []

    def train(attempt: Any) -> int:  # once per generation (cudasnap.run_inprocess)
        snap = cudasnap.Snapshotter(m, o, directory=CKPT, health=False)
        with snap:
            start = snap.restore_latest()
            pids.append(os.getpid())
            print(f"[ip] uid={uid} pid={os.getpid()} gen={attempt.gen} rank={attempt.rank} "
                  f"start={start + 1} src={(snap.stats().get('restore') or {}).get('source')}",
                  flush=True)
            for step in range(start, steps):
                attempt.check()
                train_step(m, o, step, attempt.rank, attempt.world, attempt)
                snap.boundary(step)
                print(f"[ip] uid={uid} rank={attempt.rank} step={step + 1} "
                      f"t={time.time():.3f}", flush=True)
                time.sleep(0.02)
            snap.flush()
        return int(attempt.rank)

    rank = cudasnap.run_inprocess(train)
    if rank is not None:
        dump(m, o, rank, {"pids": pids, "uid": uid})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
