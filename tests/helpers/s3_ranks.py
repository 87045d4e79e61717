"""One rank of a multi-rank job flushing to an object-store URL (tests/storage/test_s3_ranks.py).

``python tests/helpers/s3_ranks.py SCENARIO RANK WORLD URL BASE``; the ranks meet through a
gloo FileStore in BASE (``store-<scenario>``) and write BASE/<scenario>-rank-R.json and
.npz (the state they hold, numpy: no pickle). Each rank trains on its own data (no DDP:
the state is not replicated, every rank must load its own part).

* ``save``: steps 0-3, flush (every rank), steps 4-5, flush, close: steps 3 and 5 committed.
* ``kill``: as ``save``, but rank 1 is SIGKILLed while it uploads its part of step 5
  (the ``upload`` kill point); rank 0's round fails, and its retry (rank 1 dead) rewrites
  rank 1's part from its arena and commits.
* ``restore``: restore_latest() on every rank; the state it restored and where from.

The S3 endpoint, credentials, CUDASNAP_STATE_DIR and CUDASNAP_SHM_DIR come from the
environment the test gives every rank.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    out = {f"m.{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.detach().numpy().copy() for k, v in st.items()
                    if torch.is_tensor(v)})
    return out


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range,
          snap: Any) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snap.boundary(step)
    snap.wait()


def main(scenario: str, rank: int, world: int, url: str, base: Path) -> None:
    import cudasnap

    dist.init_process_group("gloo", init_method=f"file://{base}/store-{scenario}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=240))
    model, opt = model_and_opt()
    snap = cudasnap.Snapshotter(model, opt, directory=url, backend="cpu", health=False)
    res: dict[str, Any] = {"rank": rank}
    out = base / f"{scenario}-rank-{rank}"
    if scenario == "restore":
        res["start"] = snap.restore_latest()
        res["restore"] = {k: str(v) for k, v in (snap.stats()["restore"] or {}).items()}
        np.savez(f"{out}.npz", **state(model, opt))
        snap.close(flush=False)
    else:
        train(model, opt, rank, range(4), snap)
        res["flush3"] = str(snap.flush())
        np.savez(f"{out}-step3.npz", **state(model, opt))
        train(model, opt, rank, range(4, 6), snap)
        if scenario == "kill" and rank == 1:
            import cudasnap._testing.faults as faults

            faults.arm_kill("upload")  # rank 1 dies inside its upload of step 5
        elif scenario == "kill":
            # The job's answer to the death (a trigger's new flush) is switched off: this is
            # about the round itself, which retries with rank 1 dead.
            snap.dist.local.peer_failure = lambda detail: None
        np.savez(f"{out}-step5.npz", **state(model, opt))  # before rank 1 dies in the flush
        res["flush5"] = str(snap.flush())
        if scenario == "kill":  # rank 1 is gone: no close, no barrier
            Path(f"{out}.json").write_text(json.dumps(res))
            os._exit(0)
        snap.close()
    Path(f"{out}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def launch(scenario: str, url: str, base: Path, env: dict[str, str], world: int = 2,
           timeout: float = 420.0) -> list[int]:
    """Runs every rank of ``scenario`` (this file, one process per rank, as torchrun would)
    to its end; their exit codes. Each rank's output: BASE/<scenario>-rank-R.log."""
    logs = [open(base / f"{scenario}-rank-{r}.log", "wb") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, scenario, str(r), str(world), url,
                               str(base)], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        return [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def logs_of(scenario: str, base: Path) -> str:
    """The tail of every rank's log of ``scenario`` (for an assertion's message)."""
    return "\n".join(f"--- rank {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(base.glob(f"{scenario}-rank-*.log")))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
