"""Hugging Face ``transformers.Trainer`` integration: ``CudaSnapTrainerCallback``.

Usage (the same script on the first run and after a crash)::

    from cudasnap.integrations.hf import CudaSnapTrainerCallback

    snap = CudaSnapTrainerCallback(directory="ckpt")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[snap])
    trainer.train(resume_from_checkpoint=snap.resume_checkpoint())   # None on a fresh run

A ``TrainerCallback`` cannot move the Trainer's loop: the epoch and the number
of batches to skip are local variables of ``Trainer._inner_training_loop``,
computed from ``resume_from_checkpoint`` before any callback runs. So resuming
goes through the Trainer's own resume path, fed with cudasnap's state:
:meth:`CudaSnapTrainerCallback.resume_checkpoint` reads the newest snapshot's
host state (shared memory, else disk) and writes a small HF checkpoint folder
holding only ``trainer_state.json`` (the snapshot's ``TrainerState``) and an
empty weights placeholder. The Trainer then computes the epoch and the batches
to skip exactly as for one of its own checkpoints (``skip_first_batches``; the
sampler is seeded per epoch), finds no optimizer/scheduler/RNG files, and
``on_train_begin`` restores the real state from the snapshot.

Steps are HF's: the snapshot of global step N is cudasnap step N (logs, ``cudasnap
inspect``). It is taken at ``on_step_end``, or, when the Trainer logs, evaluates or saves
for that step (which it does after ``on_step_end``), at the next hook (the next step's
``on_step_begin``, ``on_epoch_end`` or ``on_train_end``); a failure in between replays
that one step. What it holds and ``on_train_begin`` restores: model parameters and
buffers, the optimizer (unwrapped from accelerate's ``AcceleratedOptimizer``), the LR
scheduler, the ``TrainerState`` (``log_history`` only with ``keep_log_history=True``;
``max_steps``, ``num_train_epochs``, ``trial_params`` and the process-zero flags come
from the resumed ``train()`` call, ``stateful_callbacks`` from ``trainer_state.json``),
the Trainer's running counters outside it (``current_flos``, which the Trainer adds to
``state.total_flos`` only at a log or save; the loss accumulators ``_tr_loss``,
``_total_loss_scalar``, ``_globalstep_last_logged``; ``_initial_global_step``,
``_initial_num_input_tokens_seen``), and the torch/CUDA/numpy/``random`` RNG states —
re-applied right before the first resumed step when resuming mid-epoch or from a
snapshot taken at ``on_step_begin`` (after the Trainer has rebuilt and fast-forwarded its
data iterator, whose creation draws from the global RNG), at ``on_train_begin`` otherwise.
So ``total_flos``, the logged losses and ``train()``'s ``training_loss`` equal an
uninterrupted run's; ``train_runtime`` and the ``*_per_second`` figures are this
process's time over the whole run's steps. The Trainer is not passed to callbacks: it is
found at ``on_train_begin`` as the calling frame's ``self`` holding this callback; when
none is (a custom loop), a warning says the counters above are not restored.

Not restored, or not replayed exactly: an fp16 ``GradScaler`` (the callback has no
handle on ``trainer.accelerator``; bf16/fp32 need none), callbacks' own state beyond
``stateful_callbacks``, and global-RNG draws made between a step's end and the next
step's forward in the original run — an evaluation run, or a data collator or dataset
that draws random numbers (e.g. MLM masking) while fetching: such batches may differ.
In a multi-rank job, ``resume_checkpoint()`` takes the newest step every rank holds
(cudasnap.integrations.hf_resume), as the restore's vote does; a vote that still picks
another step (a rank restored from a replica, say) is refused at ``on_train_begin``.
With gradient accumulation, snapshots are taken at optimizer steps only.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ..errors import ConfigError, SnapshotError
from . import hf_resume
from ._owner import SnapshotterOwner, default_health, env_directory
from .hf_resume import RESUME_DIR

log = logging.getLogger("cudasnap.hf")

STATE_KEY = "hf.trainer_state"
SCHED_KEY = "hf.lr_scheduler"
TR_LOSS_KEY = "hf.tr_loss"
# Set by the Trainer for this train() call (from its arguments), or process-local.
_NOT_RESTORED = {"is_local_process_zero", "is_world_process_zero", "stateful_callbacks",
                 "max_steps", "num_train_epochs", "trial_params"}
# The Trainer's running counters outside TrainerState: boundary value key, attribute.
_COUNTERS = (("hf_current_flos", "current_flos"), ("hf_total_loss", "_total_loss_scalar"),
             ("hf_last_logged", "_globalstep_last_logged"),
             ("hf_initial_step", "_initial_global_step"),
             ("hf_initial_tokens", "_initial_num_input_tokens_seen"))
_FRAMES = 16  # calling frames searched for the Trainer

__all__ = ["CudaSnapTrainerCallback", "RESUME_DIR"]


class _TrainerStateAdapter:
    """``transformers.TrainerState`` as a Snapshotter ``extra``."""

    def __init__(self, state: Any, keep_log_history: bool) -> None:
        self.state = state
        self.keep_log_history = keep_log_history

    def state_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.state)
        if not self.keep_log_history:
            d.pop("log_history", None)
        return d

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        fields = {f.name for f in dataclasses.fields(self.state)}
        for k, v in d.items():
            if k in fields and k not in _NOT_RESTORED:
                setattr(self.state, k, v)


def _unwrap_optimizer(opt: Any) -> Any:
    seen = 0
    while opt is not None and type(opt).__module__.startswith("accelerate") and seen < 8:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        opt, seen = inner, seen + 1
    return opt


def _host_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                           "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _set_host_rng(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])


class CudaSnapTrainerCallback(SnapshotterOwner, TrainerCallback):
    """Just-in-time snapshots of a ``transformers.Trainer`` run: ≤ 1 optimizer step lost.

    Args:
        directory: snapshot directory; default ``$CUDASNAP_DIR`` or
            ``<args.output_dir>/cudasnap``.
        extra: more objects to snapshot (``state_dict``/``load_state_dict`` or
            ``torch.Generator``).
        health: health monitor, signal handlers and watchdog (default on; set
            ``CUDASNAP_HEALTH=0`` or pass False to turn it off).
        flush_on_end: write the final snapshot to disk at ``on_train_end``.
        keep_log_history: also snapshot ``state.log_history``.
        **snapshotter_kwargs: passed to :class:`cudasnap.Snapshotter`.
    """

    def __init__(self, directory: str | os.PathLike | None = None,
                 extra: Mapping[str, Any] | None = None, health: bool | None = None,
                 flush_on_end: bool = True, keep_log_history: bool = False,
                 **snapshotter_kwargs: Any) -> None:
        self.directory = directory
        self.extra = dict(extra or {})
        self.health = health
        self.flush_on_end = flush_on_end
        self.keep_log_history = keep_log_history
        self.snapshotter_kwargs = snapshotter_kwargs
        self.snapshotter: Any = None
        self.restored_step: int | None = None  # global step resumed at (None: fresh run)
        self.last_stats: dict[str, Any] | None = None
        self._output_dir: str | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._past_end = False  # resumed at max_steps: the next step is undone
        self._pending_step: int | None = None  # global step whose boundary is deferred
        self._trainer: Any = None
        self._tr_loss_buf: torch.Tensor | None = None
        self._filter: logging.Filter | None = None

    # ------------------------------------------------------------ where
    def _dir(self) -> Path:
        if self.directory is not None:
            return Path(self.directory)
        env = env_directory()
        if env:
            return Path(env)
        if self._output_dir is None:
            raise ConfigError("CudaSnapTrainerCallback: pass directory=, or create the Trainer "
                              "first (the default is <args.output_dir>/cudasnap)")
        return Path(self._output_dir) / "cudasnap"

    def on_init_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._output_dir = args.output_dir

    # ----------------------------------------------------------- resume
    def resume_checkpoint(self) -> str | None:
        """An HF checkpoint folder for ``trainer.train(resume_from_checkpoint=...)``, or None.

        None when the directory holds no snapshot (a fresh run). The folder holds
        the newest snapshot's ``trainer_state.json`` and an empty weights file;
        the real weights, optimizer, scheduler and RNG come from the snapshot
        at ``on_train_begin``. Several ranks: the newest step every rank holds
        (cudasnap.integrations.hf_resume).
        """
        found = hf_resume.newest_host_state(self._dir(), self.snapshotter_kwargs)
        if found is None:
            return None
        step, host = found
        ent = host.get("extra", {}).get(STATE_KEY)
        if ent is None:
            raise SnapshotError(f"snapshot of step {step} in {self._dir()} holds no TrainerState "
                                "(not written by CudaSnapTrainerCallback)")
        folder = hf_resume.write_folder(self._dir(), dict(ent["state"]))
        # The Trainer loads the (empty) placeholder and warns about every key; the
        # snapshot supplies them at on_train_begin.
        if self._filter is None:
            self._filter = hf_resume.DropPlaceholderWarning()
            logging.getLogger("transformers.trainer").addFilter(self._filter)
        return str(folder)

    def _drop_filter(self) -> None:
        if self._filter is not None:
            logging.getLogger("transformers.trainer").removeFilter(self._filter)
            self._filter = None

    # ------------------------------------------------------------ hooks
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        from ..snapshotter import Snapshotter

        self._drop_filter()
        self._output_dir = args.output_dir
        self._pending_step = None
        if self.snapshotter is not None:  # a second train() in this process
            self._close(keep_arena=True)
        if model is None:
            raise ConfigError("CudaSnapTrainerCallback: the Trainer passed no model")
        self._trainer = _find_trainer(self)
        if self._trainer is None:
            log.warning(
                "cudasnap: CudaSnapTrainerCallback found no transformers.Trainer calling it "
                "(looked for one holding this callback in its callback_handler, %d frames up): "
                "its running FLOs count and loss accumulators (trainer.current_flos, _tr_loss, "
                "_total_loss_scalar, _globalstep_last_logged) are not snapshotted, so after a "
                "resume state.total_flos and the logged losses differ from an uninterrupted "
                "run", _FRAMES)
        opt = _unwrap_optimizer(optimizer)
        extras: dict[str, Any] = {STATE_KEY: _TrainerStateAdapter(state, self.keep_log_history)}
        if lr_scheduler is not None and callable(getattr(lr_scheduler, "state_dict", None)):
            extras[SCHED_KEY] = lr_scheduler
        self._tr_loss_buf = None
        tr_loss = getattr(self._trainer, "_tr_loss", None)
        if isinstance(tr_loss, torch.Tensor):
            # Copied by the engine with the state (no host sync per step); filled right
            # before each boundary, behind a fence.
            self._tr_loss_buf = torch.zeros_like(tr_loss)
            extras[TR_LOSS_KEY] = self._tr_loss_buf
        for k, v in self.extra.items():
            if k in extras:
                raise ConfigError(f"extra key {k!r} is reserved by CudaSnapTrainerCallback")
            extras[k] = v
        health = default_health(self.health)
        hf_step = int(state.global_step)  # where the Trainer's loop will resume
        self.snapshotter = Snapshotter(model, opt, self._dir(), extra=extras, health=health,
                                       **self.snapshotter_kwargs)
        start = self.snapshotter.restore_latest()
        if start == 0:
            return
        # cudasnap's step is HF's global step: the snapshot of global step N resumes at N + 1.
        if start - 1 != hf_step:
            how = ("Trainer.train() was not told to resume: pass "
                   "resume_from_checkpoint=callback.resume_checkpoint()") if hf_step == 0 else (
                f"the Trainer resumes at global step {hf_step}")
            self._close(keep_arena=True)
            raise SnapshotError(
                f"cudasnap restored global step {start - 1} from {self._dir()}, but {how}; "
                "the loop and the state would disagree (use a fresh directory to start over)")
        self.restored_step = hf_step
        values = self.snapshotter.values
        self._restore_trainer(values)
        epoch = float(state.epoch or 0.0)
        if values.get("hf_at") == "step_begin" or not epoch.is_integer():
            # Taken after the next batches were fetched: re-applied right before the first
            # resumed step, after the Trainer has rebuilt and fast-forwarded its iterator.
            self._pending_rng = _host_rng()
        log.warning("cudasnap: resumed at global step %d (epoch %.3f) from %s", hf_step, epoch,
                    self.snapshotter.stats()["restore"]["source"])
        # The snapshot of the run's last step (a kill during its end): the Trainer trains one
        # step past max_steps when resumed there (it checks the end only after a step, its
        # own checkpoints alike); that step is undone at its on_step_end.
        self._past_end = 0 < int(state.max_steps or 0) <= hf_step

    def _restore_trainer(self, values: Mapping[str, Any]) -> None:
        """Puts the Trainer's running counters back as they were at the snapshot."""
        tr = self._trainer
        if "hf_current_flos" not in values:
            log.warning("cudasnap: the snapshot holds no Trainer counters (written without "
                        "a Trainer handle): total_flos and logged losses will differ from "
                        "an uninterrupted run")
            return
        if tr is None:
            return  # warned at on_train_begin
        for key, attr in _COUNTERS:
            if key in values:
                setattr(tr, attr, values[key])
        buf = self._tr_loss_buf
        if buf is not None and isinstance(getattr(tr, "_tr_loss", None), torch.Tensor):
            with torch.no_grad():
                tr._tr_loss.copy_(buf)

    def _trainer_values(self, at: str) -> dict[str, Any]:
        tr = self._trainer
        vals: dict[str, Any] = {"hf_at": at}
        if tr is None:
            return vals
        for key, attr in _COUNTERS:
            v = getattr(tr, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals[key] = v
        buf = self._tr_loss_buf
        if buf is not None and self.snapshotter is not None:
            self.snapshotter.fence()  # the running copy may still read buf
            with torch.no_grad():
                buf.copy_(tr._tr_loss)
        return vals

    def _take(self, at: str) -> None:
        """The deferred boundary of the last optimizer step, now that the Trainer has
        logged, evaluated and saved for it."""
        step, self._pending_step = self._pending_step, None
        if step is not None and self.snapshotter is not None:
            self.snapshotter.boundary(step, **self._trainer_values(at))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._take("step_begin")
        if self._pending_rng is not None:
            _set_host_rng(self._pending_rng)
            self._pending_rng = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.snapshotter is None:
            return
        if self._past_end:  # resumed at the last step: this step was one too many
            self._past_end = False
            self.snapshotter.restore_latest()  # the same snapshot: model, optimizer, state, RNG
            self._restore_trainer(self.snapshotter.values)
            control.should_training_stop = True
            log.warning("cudasnap: the run had reached max_steps (%d) when it was stopped; the "
                        "step the Trainer trains past it on a resume was undone",
                        int(state.max_steps))
            return
        self._pending_step = int(state.global_step)
        # When the Trainer logs, evaluates or saves for this step (after on_step_end:
        # store_flos, log_history, best metric), the boundary waits for the next hook.
        if not (control.should_log or control.should_evaluate or control.should_save):
            self._take("step_end")

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # Before the next epoch's iterator is made, unless an epoch strategy logs,
        # evaluates or saves after this hook (then at the next step's begin).
        if not (control.should_log or control.should_evaluate or control.should_save):
            self._take("epoch_end")

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._take("train_end")
        self._trainer = None
        self._end_training(self.flush_on_end)


def _find_trainer(cb: Any) -> Any:
    """The ``transformers.Trainer`` whose callback handler holds ``cb``: ``self`` of a
    calling frame (the Trainer does not pass itself to callbacks); None if none is."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - transformers without torch support
        return None
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(_FRAMES):
            if f is None:
                break
            obj = f.f_locals.get("self")
            if isinstance(obj, Trainer):
                handler = getattr(obj, "callback_handler", None)
                if any(c is cb for c in getattr(handler, "callbacks", ())):
                    return obj
            f = f.f_back
        return None
    finally:
        del frame, f

