"""A 2-rank job (gloo, CPU) that ends in one of the ways a trainer's ``close()`` is reached,
for tests/distributed/test_close_keeps_arena.py.

Env: OUT, CKPT, STORE_DIR (a FileStore per attempt), END:
  "peer_error": rank 1 raises (a peer's "Connection reset", say); both ranks call
      ``snap.close()`` inside their ``except`` block, as torchtitan's ``main()`` does;
  "no_flush": both ranks end normally and call ``close()`` without a final ``flush()``;
  "flushed": ``flush()`` on every rank, then ``close()`` (a finished job);
  "discard": ``close(keep_arena=False)`` inside ``except`` (the caller says: not needed).
Each rank writes OUT/rank-<R>.json: its arena path and whether it exists after close().
"""
from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import cudasnap


def main() -> int:
    torch.set_num_threads(1)
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE_DIR']}/store",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))
    rank, end = dist.get_rank(), os.environ["END"]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = cudasnap.Snapshotter(model, opt, directory=os.environ["CKPT"], health=False)
    for step in range(3):
        model(torch.randn(2, 8)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        snap.boundary(step)
    snap.wait()
    arena = snap.arena_path
    if end == "flushed":
        snap.flush()
    dist.barrier()
    try:
        if end in ("peer_error", "discard") and rank == 1:
            raise RuntimeError("Connection reset by peer (injected)")
        if end in ("peer_error", "discard"):
            raise RuntimeError("rank 1 failed: Connection reset by peer (injected)")
        snap.close()
    except RuntimeError:
        snap.close(keep_arena=False if end == "discard" else None)
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"arena": str(arena), "exists": Path(arena).exists()}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
