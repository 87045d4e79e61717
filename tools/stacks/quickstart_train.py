"""The README's quick start as a stack for the kill harness (tools/stacks/killer.py): the same
loop (a prefetched batch saved per step with ``boundary(step, X=X)``, a StepLR scheduler,
AdamW), with the harness's per-step lines and a final dump.

    python tools/stacks/quickstart_train.py [--ref] [--steps N] [--optim NAME]

``--ref``: no cudasnap (the uninterrupted reference). Directory: ``$CUDASNAP_DIR`` (set by
``cudasnap run``) or ./ckpt. Prints ``[stack] rank=0 start=S`` and ``[stack] rank=0
step=S t=<time>`` (S counts from 1: the step just trained); ``STACK_DUMP=PATH`` writes
PATH.rank0.pt at the end (parameters, optimizer state, scheduler, the next batch, RNG).
``--optim``: ``adamw`` (the README's), or torchao's low-bit ``adamw8bit``, ``adamw4bit``,
``adamwfp8`` (tensor-subclass state, issue 45: its weights have 65,536 elements, above the
4,096 torchao quantizes from; a subclass value is dumped as its inner tensors).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
from tools.stacks.dump_tensors import plain_tensors  # noqa: E402

OPTIMS = ("adamw", "adamw8bit", "adamw4bit", "adamwfp8")


def _optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params)  # type: ignore[arg-type]
    import torchao.optim as ao

    cls = {"adamw8bit": ao.AdamW8bit, "adamw4bit": ao.AdamW4bit, "adamwfp8": ao.AdamWFp8}[name]
    return cls(params, lr=1e-3)  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--optim", choices=OPTIMS, default="adamw")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 256))
    opt = _optimizer(a.optim, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    snap = None
    start = 0
    if not a.ref:
        import cudasnap

        snap = cudasnap.Snapshotter(model, opt, extra={"sched": sched})
        start = snap.restore_latest()
    X = snap.values["X"] if start and snap is not None else torch.randn(8, 256)
    print(f"[stack] rank=0 start={start + 1} pid={os.getpid()}", flush=True)
    for step in range(start, a.steps):
        model(X).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        X = torch.randn(8, 256)
        if snap is not None:
            snap.boundary(step, X=X)
        print(f"[stack] rank=0 step={step + 1} t={time.time():.3f}", flush=True)
        time.sleep(0.01)  # a step of some length: the kill lands inside one
    if snap is not None:
        snap.close()
    path = os.environ.get("STACK_DUMP")
    if path:
        tensors = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for i, st in enumerate(opt.state.values()):
            for k, v in st.items():
                tensors.update(plain_tensors(f"optim.{i}.{k}", v))
        tensors["next_batch"] = X
        tensors["rng.torch"] = torch.get_rng_state()
        torch.save({"tensors": tensors, "info": {"sched": sched.state_dict()}},
                   f"{path}.rank0.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
