"""torchao's AdamW8bit under FSDP2 on 2 ranks (gloo, CPU), for
tests/distributed/test_subclass_fsdp2.py: its state is a DTensor whose local shard is an
OptimState8bit (issue 45).

One torchrun: an uninterrupted run of 6 steps; a run under cudasnap of 3 steps, flushed and
closed; a new model and optimizer (no state yet) restored from it and trained to step 6;
then a rollback of that Snapshotter into its live state, flushed. Each rank writes
OUT/rank-<R>.pt (its dequantized local exp_avg of the first weight, for the export check) and
OUT/rank-<R>.json: the step resumed at, the state's type, and the names that differ from the
uninterrupted run (after the resume) and from the snapshot (after the rollback)."""
from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torchao.optim import AdamW8bit

import cudasnap


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # 128 x 128 sharded in 2: 8,192 local elements, quantized
    m = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 8))
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    return m, AdamW8bit(m.parameters(), lr=1e-2)


def step(m: torch.nn.Module, o: torch.optim.Optimizer, i: int, rank: int) -> None:
    g = torch.Generator().manual_seed(i * 10 + rank)
    m(torch.randn(8, 128, generator=g)).square().mean().backward()
    o.step()
    o.zero_grad(set_to_none=True)


def state(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.to_local().clone() for k, v in m.state_dict().items()}
    for j, st in enumerate(o.state.values()):
        for k, v in st.items():
            loc = v.to_local() if hasattr(v, "to_local") else v
            if type(loc) is torch.Tensor:
                out[f"o{j}.{k}"] = loc.clone()
            else:
                for a in loc.__tensor_flatten__()[0]:
                    out[f"o{j}.{k}.{a}"] = getattr(loc, a).clone()
    return out


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def main() -> int:
    torch.set_num_threads(1)
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE_DIR']}/store",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    m, o = make()
    for i in range(6):
        step(m, o, i, rank)
    ref = state(m, o)
    m, o = make()
    snap = cudasnap.Snapshotter(m, o, directory=os.environ["CKPT"], health=False)
    for i in range(3):
        step(m, o, i, rank)
        snap.boundary(i)
    snap.flush()
    snap.close()
    m, o = make()
    snap = cudasnap.Snapshotter(m, o, directory=os.environ["CKPT"], health=False)
    start = snap.restore_latest()
    v = o.state[next(iter(m.parameters()))]["exp_avg"]
    kind = f"{type(v).__name__}({type(v.to_local()).__name__})"
    for i in range(start, 6):
        step(m, o, i, rank)
        snap.boundary(i)
    snap.wait()
    resumed = differ(ref, state(m, o))
    at5 = state(m, o)
    step(m, o, 6, rank)
    back = snap.rollback()
    rolled = differ(at5, state(m, o))
    flushed = snap.flush()  # the rolled-back state (step 5): what `export --to dcp` holds
    snap.close()
    w = next(iter(m.parameters()))
    local = o.state[w]["exp_avg"].to_local()
    plain = torch.empty(local.shape, dtype=local.dtype)
    plain.copy_(local)  # the subclass's own dequantization
    torch.save({"exp_avg": plain, "rows": w.to_local().shape[0]}, out / f"rank-{rank}.pt")
    (out / f"rank-{rank}.json").write_text(json.dumps(
        {"start": start, "kind": kind, "resumed_differ": resumed, "rollback": back,
         "rolled_differ": rolled, "names": len(ref), "flushed": str(flushed)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
