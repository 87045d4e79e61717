"""The demo's training script: a small model on synthetic data, snapshotted every step.

Run by ``cudasnap demo`` (under ``cudasnap run``). It is also the shape of a
real integration: the two cudasnap lines are the Snapshotter and
``restore_latest()``, plus ``boundary(step)`` in the loop.
"""
from __future__ import annotations

import time

T_SCRIPT = time.time()  # before any heavy import: the recovery breakdown's "interpreter" end

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

T_TORCH = time.time()

import cudasnap  # noqa: E402
from cudasnap._proc import process_start_time  # noqa: E402
from cudasnap.config import Settings  # noqa: E402

T_CUDASNAP = time.time()


class SyntheticData:
    """Batches from a seeded generator; its position is part of the snapshot."""

    def __init__(self, dim: int, batch: int, seed: int = 1234) -> None:
        self.dim, self.batch = dim, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch, self.dim, generator=self.gen)
        y = torch.randint(0, 10, (self.batch,), generator=self.gen)
        self.position += 1
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])
        self.gen.set_state(sd["gen"])


def build(dim: int, hidden: int, layers: int, device: str) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(dim, hidden), torch.nn.BatchNorm1d(hidden),
                                   torch.nn.GELU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    mods.append(torch.nn.Linear(hidden, 10))
    model = torch.nn.Sequential(*mods).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return model, opt, sched


def final_state(model: torch.nn.Module, opt: Any) -> dict[str, np.ndarray]:
    out = {f"model.{k}": v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v.detach().cpu().numpy().copy()
    out["rng.torch"] = torch.get_rng_state().numpy().copy()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fail-at", type=int, default=-1, help="SIGKILL mid-iteration at this step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="final state (.npz, no pickle)")
    p.add_argument("--stats", required=True, help="per-attempt JSON lines")
    p.add_argument("--no-snapshot", action="store_true", help="reference run")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # bitwise-reproducible CPU kernels
    model, opt, sched = build(a.dim, a.hidden, a.layers, a.device)
    data = SyntheticData(a.dim, a.batch)
    attempt = Settings.from_env().restart
    snap = None
    start = 0
    t_start = time.time()
    t_restored = t_start
    if not a.no_snapshot:
        snap = cudasnap.Snapshotter(model, opt, extra={"sched": sched, "data": data})
        start = snap.restore_latest()
        t_restored = time.time()
    t_first = None
    for step in range(start, a.steps):
        if snap is not None and snap.guard is not None and snap.guard.should_hang(step):
            time.sleep(3600)  # injected hang: the watchdog must fire
        x, y = data.next()
        x, y = x.to(a.device), y.to(a.device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == a.fail_at and attempt == 0:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-iteration, before optimizer.step
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if snap is not None:
            snap.boundary(step)
        if t_first is None:
            t_first = time.time()
    rec: dict[str, Any] = {"attempt": attempt, "start": start, "pid": os.getpid(),
                           "t_exec": process_start_time(), "t_script": T_SCRIPT,
                           "t_torch": T_TORCH, "t_cudasnap": T_CUDASNAP,
                           "t_start": t_start, "t_restored": t_restored, "t_first_step": t_first}
    standby = sys.modules.get("cudasnap.supervisor.standby")  # started warm by `cudasnap run`
    if standby is not None and getattr(standby, "go_time", None) is not None:
        rec.update(warm=True, t_go=standby.go_time, t_ready=standby.ready_time)
    if snap is not None:
        snap.wait()
        rec.update(snap.stats())
        snap.close()
    arrays: dict[str, Any] = final_state(model, opt)
    np.savez(a.out, **arrays)
    with open(a.stats, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
