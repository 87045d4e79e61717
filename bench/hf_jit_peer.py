"""Peer for bench/peers.py: Hugging Face Transformers' ``enable_jit_checkpoint``.

With ``TrainingArguments(enable_jit_checkpoint=True)`` the Trainer installs a
SIGTERM handler (``transformers.trainer_jit_checkpoint``) that, after a fixed
``kill_wait`` grace period (3 s), sets a flag; the next callback hook
(``on_step_begin``/``on_pre_optimizer_step``/``on_step_end``) stops training and
runs ``Trainer._save_checkpoint`` on the live state: model weights, optimizer,
scheduler, RNG and trainer state, written synchronously from the training
thread. Nothing is staged, so "blocked" equals "durable".

Here the same state as the other peers goes into a Trainer (the bench model is a
plain ``nn.Module`` with the AdamW optimizer passed in), the SIGTERM handler is
invoked as the signal would, its grace period is recorded apart (``grace_s``) and
skipped, and ``execute_jit_checkpoint()`` is timed, then the files are fsync'd
(the Trainer does not fsync). Restore: ``load_state_dict`` of the saved model and
optimizer files (what ``resume_from_checkpoint`` does for them).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import _common as C


def hf_jit_peer(cx: Any) -> None:
    name = "hf enable_jit_checkpoint"
    try:
        import torch
        from transformers import Trainer, TrainingArguments
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback
    except Exception as e:
        cx.out[name] = {"error": f"import transformers failed: {type(e).__name__}: {e}"}
        return
    out_dir = cx.tmp / "hf"
    args = TrainingArguments(output_dir=str(out_dir), enable_jit_checkpoint=True,
                             use_cpu=True, report_to=[],
                             disable_tqdm=True, logging_strategy="no")
    trainer = Trainer(model=cx.model, args=args, optimizers=(cx.opt, None))
    trainer.create_scheduler(num_training_steps=1000, optimizer=cx.opt)
    cb = next((c for c in trainer.callback_handler.callbacks
               if isinstance(c, JITCheckpointCallback)), None)
    if cb is None or cb.jit_manager is None:
        cx.out[name] = {"error": "Trainer did not install the JIT checkpoint callback"}
        return
    jm = cb.jit_manager
    step = [0]

    def ckpt_dir() -> Path:
        return out_dir / f"checkpoint-{step[0]}"

    def save(_r: int) -> dict[str, float]:
        step[0] += 1
        trainer.state.global_step = step[0]
        # SIGTERM runs jm._sigterm_handler, which arms a kill_wait timer whose action is
        # _enable_checkpoint; the grace period is reported apart and not waited here.
        if signal.getsignal(signal.SIGTERM) != jm._sigterm_handler:
            raise RuntimeError("enable_jit_checkpoint did not install its SIGTERM handler")
        grace = float(jm.kill_wait)
        jm._enable_checkpoint()
        if not jm.is_checkpoint_requested:
            raise RuntimeError("the JIT checkpoint was not requested by the SIGTERM handler")
        t0 = time.perf_counter()
        jm.execute_jit_checkpoint()
        blocked = time.perf_counter() - t0
        C.fsync_tree(ckpt_dir())
        durable = time.perf_counter() - t0
        return {"blocked": blocked, "durable": durable, "grace_s": grace,
                "signal_to_durable": grace + durable}

    def restore(_r: int) -> dict[str, float]:
        d = ckpt_dir()
        for f in d.rglob("*"):
            if f.is_file():
                C.drop_cache(f)
        t0 = time.perf_counter()
        st = d / "model.safetensors"
        if st.exists():
            from safetensors.torch import load_file

            sd = load_file(str(st))
        else:
            sd = torch.load(d / "pytorch_model.bin", weights_only=True)
        cx.model.load_state_dict(sd)
        cx.opt.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
        return {"restore_disk": time.perf_counter() - t0}

    cx.measure(name, save, restore, lambda: C.rm(ckpt_dir()))
