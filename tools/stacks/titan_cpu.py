"""torchtitan 0.3.0's own train entry (``torchtitan.train.main``) on CPU with gloo, for tests
and the kill harness (tools/stacks/killer.py).

torchtitan 0.3.0 assumes CUDA. Three in-process changes make its llama3 debug model train
on CPU, none of which touches what a checkpoint holds:

1. Device: ``torchtitan.tools.utils`` picks ``_get_available_device_type() or "cuda"`` at
   import time; it is made to pick "cpu" (with a CPU "device module" for the few
   ``torch.cuda``-style calls torchtitan makes), so the backend is gloo.
2. Attention: the debug model's only usable backend is flex attention, whose backward
   torch refuses on CPU; its block-causal mask is materialised and run through SDPA.
3. FSDP2 reduce-scatters with ``PREMUL_SUM(1.0)`` (torchtitan's divide factor 1.0), which
   gloo refuses; plain SUM gives the same result.

Env: ``TT_DUMP=PATH``: at the end every rank writes PATH.rank<R>.pt (full parameters, full
optimizer state, LR scheduler, its dataloader state, the trainer's counters, the CPU RNG
state) for the test to compare; parameters come from ``named_parameters()`` (the real
``wqkv``); not on the exception path (a peer is gone: the gathers would fail).
``TT_ATTN_DROPOUT=P``: attention dropout P (draws from the CPU generator in every forward).

Prints ``[stack] rank=R start=S`` before the first step this process trains (S: that step)
and ``[stack] rank=R step=S t=<time>`` after each step (the kill harness reads them).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import types

import torch
import torch._utils

# SIGUSR2 prints every thread's Python stack (cudasnap keeps SIGUSR1 for a flush): the test
# sends it to a run it is about to kill.
faulthandler.register(signal.SIGUSR2, all_threads=True)

_cpu = types.ModuleType("titan_cpu_device")
for _k in dir(torch.cpu):
    if not _k.startswith("__"):
        setattr(_cpu, _k, getattr(torch.cpu, _k))
_cpu.current_device = lambda: 0  # type: ignore[attr-defined]
_cpu.get_device_name = lambda *a, **k: "cpu"  # type: ignore[attr-defined]
_cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(  # type: ignore[attr-defined]
    name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
_cpu.memory_stats = lambda *a, **k: {}  # type: ignore[attr-defined]
_cpu.reset_peak_memory_stats = lambda *a, **k: None  # type: ignore[attr-defined]
_cpu.empty_cache = lambda *a, **k: None  # type: ignore[attr-defined]

_orig_module = torch._utils._get_device_module
torch._utils._get_available_device_type = lambda: "cpu"
torch._utils._get_device_module = (
    lambda device_type=None: _cpu if device_type == "cpu" else _orig_module(device_type))

import torchtitan.tools.utils as _tt_utils  # noqa: E402

assert _tt_utils.device_type == "cpu", _tt_utils.device_type
torch._utils._get_device_module = _orig_module  # only torchtitan saw the stand-in

import torchtitan.distributed.fsdp as _tt_fsdp  # noqa: E402
import torchtitan.train  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

_DROPOUT = float(os.environ.get("TT_ATTN_DROPOUT") or 0.0)


def _eager_flex_attn(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                     kernel_options):
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None, "mask_mod only"
    b, lq, lkv = q.shape[0], q.shape[2], k.shape[2]
    mb = block_mask.shape[0]
    mask = create_mask(block_mask.mask_mod, mb, None, lq, lkv, device=q.device)
    if mb == 1 and b > 1:
        mask = mask.expand(b, -1, -1, -1)
    aux = types.SimpleNamespace(lse=None, max_scores=None)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa,
                                                           dropout_p=_DROPOUT)
    return out, aux


FlexAttention.compiled_flex_attn = staticmethod(_eager_flex_attn)
_orig_disable_div = _tt_fsdp.disable_fsdp_gradient_division


def _disable_div_and_force_sum(model):
    _orig_disable_div(model)
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


_tt_fsdp.disable_fsdp_gradient_division = _disable_div_and_force_sum


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _dump(trainer, path: str) -> None:
    """Every rank: its full state (gathering is a collective: every rank calls it)."""
    parts = trainer.model_parts  # several with pipeline parallelism (one per stage here)
    pre = [f"part{i}." if len(parts) > 1 else "" for i in range(len(parts))]
    named = [(pre[i] + n, p) for i, m in enumerate(parts) for n, p in m.named_parameters()]
    names = {id(p): n for n, p in named}
    out = {f"param.{n}": _full(p) for n, p in named}
    out["rng.torch"] = torch.get_rng_state()  # before the data iterator below draws
    for i, opt in enumerate(trainer.optimizers.optimizers):
        for p in sorted(opt.state, key=lambda q: names[id(q)]):
            for k, v in sorted(opt.state[p].items()):
                out[f"optim{i}.{names[id(p)]}.{k}"] = _full(v)
    dl = trainer.dataloader
    state = dl.state_dict()
    # What a job restored from this dataloader state trains on next: torchtitan's text
    # reader reads one document ahead after any load_state_dict (its own checkpoints
    # too), so two states that yield the same stream can differ in their buffers.
    dl.load_state_dict(state)
    it = iter(dl)
    for i in range(2):
        inputs, labels = next(it)
        out[f"next_batch{i}.inputs"] = inputs["input"].clone()
        out[f"next_batch{i}.labels"] = labels.clone()
    info = {"step": trainer.step, "ntokens_seen": trainer.ntokens_seen,
            "lr_scheduler": [s.state_dict() for s in trainer.lr_schedulers.schedulers],
            "lr": [g["lr"] for o in trainer.optimizers.optimizers for g in o.param_groups],
            "dataloader_keys": sorted(state)}
    torch.save({"tensors": out, "info": info},
               f"{path}.rank{torch.distributed.get_rank()}.pt")


_orig_close = Trainer.close


def _close(self):
    path = os.environ.get("TT_DUMP")
    if path and torch.distributed.is_initialized() and sys.exc_info()[1] is None:
        _dump(self, path)
    return _orig_close(self)


Trainer.close = _close
_orig_train_step = Trainer.train_step


def _train_step_then_maybe_die(self, *args, **kwargs):
    """``TT_PLAIN_KILL_STEP``/``TT_PLAIN_KILL_RANK``: SIGKILL after that step in the first
    torchrun attempt (a kill with no cudasnap in the job)."""
    rank = torch.distributed.get_rank()
    if not getattr(self, "_stack_started", False):
        self._stack_started = True
        print(f"[stack] rank={rank} start={self.step} pid={os.getpid()}", flush=True)
    out = _orig_train_step(self, *args, **kwargs)
    print(f"[stack] rank={rank} step={self.step} t={time.time():.3f}", flush=True)
    if str(self.step) == os.environ.get("TT_PLAIN_KILL_STEP") and \
            str(torch.distributed.get_rank()) == os.environ.get("TT_PLAIN_KILL_RANK") and \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), 9)
    return out


Trainer.train_step = _train_step_then_maybe_die

if __name__ == "__main__":
    sys.exit(torchtitan.train.main())
