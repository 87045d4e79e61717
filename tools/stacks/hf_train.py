"""A Hugging Face ``Trainer`` run for kill trials: tiny GPT-2, synthetic tokens, CPU.

    python tools/stacks/hf_train.py [--steps 40] [--ref] [--dir D] [--lora R] [--optim NAME]
    python -m torch.distributed.run --standalone --nproc-per-node=2 tools/stacks/hf_train.py
    python tools/stacks/hf_train.py --compare A.rank0.pt B.rank0.pt

Without ``--ref`` it trains under ``CudaSnapTrainerCallback`` (directory ``--dir`` or
``$CUDASNAP_DIR``) and resumes the way the README tells users to:
``trainer.train(resume_from_checkpoint=cb.resume_checkpoint())``. ``--ref`` trains
without cudasnap (the uninterrupted reference). Seeded init, dropout on, AdamW with a
linear warmup schedule, logging every 5 steps, DDP over gloo under torchrun. ``--lora R``:
a PEFT LoRA of rank R on the attention and MLP projections (the base frozen); ``--optim``:
the Trainer's ``optim`` (e.g. ``adamw_torch_8bit``: torchao's AdamW8bit, whose state of
4,096 elements or more is a tensor subclass, issue 45).

stdout (flushed): ``[stack] rank=R start=S`` once when training begins (S: the first
global step this process trains) and ``[stack] rank=R step=S t=<time.time()>`` after each
optimizer step. ``STACK_DUMP=PATH``: at a normal end each rank writes
``PATH.rank<R>.pt``: ``{"tensors": parameters, optimizer state, CPU RNG; "info":
TrainerState, scheduler, lr, python/numpy RNG digests, the next two batches}``;
``--compare`` tells whether two dumps are identical (exit 0) or lists what differs (1).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

VOCAB, SEQ, N_SEQ = 256, 32, 400

def _timed(key: str) -> bool:
    """A log entry's wall-clock figure (train_runtime, *_per_second): never equal across runs."""
    return key.endswith(("_runtime", "_per_second"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _say(msg: str) -> None:
    print(f"[stack] rank={_rank()} {msg}", flush=True)


def _digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _dump(trainer: Any, path: str) -> None:
    import numpy as np
    import torch

    from tools.stacks.dump_tensors import plain_tensors

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    tensors: dict[str, torch.Tensor] = {}
    names = {}
    for n, p in model.named_parameters():
        tensors[f"param.{n}"] = p.detach().clone()
        names[id(p)] = n
    opt = trainer.optimizer
    while not isinstance(opt, torch.optim.Optimizer) or type(opt).__module__.startswith("accelerate"):
        opt = opt.optimizer
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors.update(plain_tensors(f"optim.{names[id(p)]}.{k}", v))
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    st = trainer.state
    state = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    hist = [{k: v for k, v in e.items() if not _timed(k)} for e in state.pop("log_history")]
    key, pos = np.random.get_state()[1:3]
    info = {
        "trainer_state": state,
        "log_history": hist,
        "current_flos": trainer.current_flos,
        "lr_scheduler": trainer.lr_scheduler.state_dict(),
        "lr": opt.param_groups[0]["lr"],
        "python_random": _digest(repr(random.getstate()).encode()),
        "numpy_random": _digest(np.asarray(key).tobytes() + str(int(pos)).encode()),
        "next_batches": _next_batches(trainer),
    }
    torch.save({"tensors": tensors, "info": info}, f"{path}.rank{_rank()}.pt")


def _next_batches(trainer: Any, n: int = 2) -> list[list[list[int]]]:
    """The input ids of the next ``n`` batches the train dataloader would yield (data position)."""
    dl = trainer.callback_handler.train_dataloader
    per_epoch = len(dl)
    g = trainer.state.global_step
    out: list[list[list[int]]] = []
    while len(out) < n:
        epoch, skip = divmod(g + len(out), per_epoch)
        dl.set_epoch(epoch)
        for i, batch in enumerate(dl):
            if i >= skip:
                out.append(batch["input_ids"].tolist())
                if len(out) == n or skip + len(out) >= per_epoch:
                    break
    return out


def compare(a_path: str, b_path: str) -> list[str]:
    """What differs between two dumps ([] when identical, bit for bit)."""
    import json

    import torch

    def canon(x: Any) -> str:  # dict order aside; floats by repr (exact)
        return json.dumps(x, sort_keys=True, default=repr)

    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    diff = []
    ta, tb = a["tensors"], b["tensors"]
    for k in sorted(set(ta) | set(tb)):
        if k not in ta or k not in tb:
            diff.append(f"{k}: only in one dump")
        elif ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k]):
            diff.append(f"tensor {k}")
    ia, ib = a["info"], b["info"]
    for k in sorted(set(ia) | set(ib)):
        if k == "trainer_state":
            sa, sb = ia[k], ib[k]
            diff += [f"TrainerState.{f}: {sa.get(f)!r} != {sb.get(f)!r}"
                     for f in sorted(set(sa) | set(sb)) if canon(sa.get(f)) != canon(sb.get(f))]
        elif canon(ia.get(k)) != canon(ib.get(k)):
            diff.append(f"{k}: {ia.get(k)!r} != {ib.get(k)!r}"[:400])
    return diff


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="max_steps (default 40)")
    ap.add_argument("--ref", action="store_true", help="train without cudasnap")
    ap.add_argument("--dir", default=None, help="snapshot directory (default $CUDASNAP_DIR)")
    ap.add_argument("--compare", nargs=2, metavar="DUMP", help="compare two dumps and exit")
    ap.add_argument("--lora", type=int, default=0, help="PEFT LoRA rank (0: full fine-tune)")
    ap.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim")
    a = ap.parse_args(argv)
    if a.compare:
        diff = compare(*a.compare)
        print("identical" if not diff else "\n".join(diff))
        return 1 if diff else 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, str(REPO))
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (N_SEQ, SEQ), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return N_SEQ

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                       n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
                                       attn_pdrop=0.1))
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=a.lora, lora_alpha=2 * a.lora,
                                                 lora_dropout=0.1, fan_in_fan_out=True,
                                                 target_modules=["c_attn", "c_proj", "c_fc"]))
    out_dir = tempfile.mkdtemp(prefix="hf-stack-")
    distributed = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1  # torchrun: DDP over gloo
    args = TrainingArguments(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, optim=a.optim, lr_scheduler_type="linear", warmup_steps=5,
        logging_steps=5, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True,
        ddp_backend="gloo" if distributed else None, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen="all", ddp_find_unused_parameters=False)

    class Printer(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _say(f"start={state.global_step + 1} pid={os.getpid()}")

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _say(f"step={state.global_step} t={time.time():.3f}")

    callbacks: list[Any] = []
    cb = None
    if not a.ref:
        from cudasnap.integrations.hf import CudaSnapTrainerCallback

        directory = a.dir or os.environ.get("CUDASNAP_DIR")
        if not directory:
            ap.error("pass --dir or set CUDASNAP_DIR (or --ref)")
        cb = CudaSnapTrainerCallback(directory=directory, keep_log_history=True)
        callbacks.append(cb)
    callbacks.append(Printer())
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=cb.resume_checkpoint() if cb is not None else None)
    dump = os.environ.get("STACK_DUMP")
    if dump:
        _dump(trainer, dump)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
