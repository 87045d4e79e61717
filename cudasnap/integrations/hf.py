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

What is snapshotted at every ``on_step_end`` (after the optimizer and LR
scheduler step) and restored at ``on_train_begin``: model parameters and
buffers, the optimizer (unwrapped from accelerate's ``AcceleratedOptimizer``),
the LR scheduler, the ``TrainerState`` counters (global step, epoch, FLOs,
tokens seen, best metric/checkpoint), and the torch/CUDA/numpy/``random`` RNG
states — re-applied right before the first resumed step when resuming
mid-epoch (after the Trainer has rebuilt and fast-forwarded its data
iterator, whose creation draws from the global RNG), at ``on_train_begin``
when resuming at an epoch boundary. This mirrors where the Trainer loads its
own ``rng_state.pth``.

Not restored, or not replayed exactly: ``state.log_history`` (unless
``keep_log_history=True``; it grows with the run and is re-encoded at every
step), an fp16 ``GradScaler`` (the callback has no handle on
``trainer.accelerator``; bf16/fp32 need none), callbacks' own state, and
global-RNG draws made between a step's end and the next step's forward in the
original run — an evaluation run, or a data collator or dataset that draws
random numbers (e.g. MLM masking) while fetching: such batches may differ.
With gradient accumulation, snapshots are taken at optimizer steps only.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ..config import Settings
from ..errors import ConfigError, SnapshotError
from ..format import codec, paths
from ..storage import posix
from ._owner import SnapshotterOwner, default_health, env_directory

log = logging.getLogger("cudasnap.hf")

RESUME_DIR = "hf-resume"
STATE_KEY = "hf.trainer_state"
SCHED_KEY = "hf.lr_scheduler"
_MISSING_KEYS_MSG = "There were missing keys in the checkpoint model loaded"
_NOT_RESTORED = {"is_local_process_zero", "is_world_process_zero", "stateful_callbacks"}

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


class _DropPlaceholderWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_MISSING_KEYS_MSG)


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
    def _newest_host_state(self) -> tuple[int, dict[str, Any]] | None:
        """(step, decoded host state) of the newest snapshot, shared memory first."""
        from .._native import native

        d = self._dir()
        kw = self.snapshotter_kwargs
        best: tuple[int, dict[str, Any]] | None = None
        if d.is_dir():
            cfg = Settings.from_env()
            job = kw.get("job") or cfg.job or paths.job_id(d)
            rank = kw.get("rank")
            rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
            shm = Path(kw.get("shm_dir") or cfg.shm_dir)
            arena_path = paths.arena_path(shm, job, rank)
            if arena_path.exists():
                try:
                    arena = native().Arena.open(str(arena_path), False)
                    slot = arena.newest_complete()
                    if slot >= 0:
                        meta = json.loads(arena.read_meta(slot))
                        best = (int(arena.slot_info(slot)["step"]), meta["host"])
                except (SnapshotError, ValueError, KeyError) as e:
                    log.warning("cannot read the staging arena %s: %s", arena_path, e)
            for s in posix.list_snapshots(d):
                if best is not None and s.step <= best[0]:
                    break
                try:
                    best = (s.step, posix.load_manifest(s.manifest_path)["host"])
                    break
                except SnapshotError as e:
                    log.warning("skipping snapshot %s: %s", s.path, e)
        if best is None:
            return None
        return best[0], codec.decode(best[1], "host")

    def resume_checkpoint(self) -> str | None:
        """An HF checkpoint folder for ``trainer.train(resume_from_checkpoint=...)``, or None.

        None when the directory holds no snapshot (a fresh run). The folder holds
        the newest snapshot's ``trainer_state.json`` and an empty weights file;
        the real weights, optimizer, scheduler and RNG come from the snapshot
        at ``on_train_begin``.
        """
        found = self._newest_host_state()
        if found is None:
            return None
        step, host = found
        ent = host.get("extra", {}).get(STATE_KEY)
        if ent is None:
            raise SnapshotError(f"snapshot of step {step} in {self._dir()} holds no TrainerState "
                                "(not written by CudaSnapTrainerCallback)")
        ts = dict(ent["state"])
        ts.setdefault("log_history", [])
        folder = self._dir() / RESUME_DIR
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = folder / f".trainer_state.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(ts, indent=2, sort_keys=True))
        os.replace(tmp, folder / "trainer_state.json")  # ranks may share the folder
        placeholder = folder / "model.safetensors"
        if not placeholder.exists():
            from safetensors.torch import save_file

            ptmp = folder / f".model.safetensors.tmp-{os.getpid()}"
            save_file({}, str(ptmp), metadata={"cudasnap": "placeholder: the weights come "
                                               "from the cudasnap snapshot"})
            os.replace(ptmp, placeholder)
        # The Trainer loads the (empty) placeholder and warns about every key; the
        # snapshot supplies them at on_train_begin.
        if self._filter is None:
            self._filter = _DropPlaceholderWarning()
            logging.getLogger("transformers.trainer").addFilter(self._filter)
        log.info("resuming from the cudasnap snapshot of global step %d via %s",
                 int(ts.get("global_step", 0)), folder)
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
        if self.snapshotter is not None:  # a second train() in this process
            self._close(keep_arena=True)
        if model is None:
            raise ConfigError("CudaSnapTrainerCallback: the Trainer passed no model")
        opt = _unwrap_optimizer(optimizer)
        extras: dict[str, Any] = {STATE_KEY: _TrainerStateAdapter(state, self.keep_log_history)}
        if lr_scheduler is not None and callable(getattr(lr_scheduler, "state_dict", None)):
            extras[SCHED_KEY] = lr_scheduler
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
        if start != hf_step:
            how = ("Trainer.train() was not told to resume: pass "
                   "resume_from_checkpoint=callback.resume_checkpoint()") if hf_step == 0 else (
                f"the Trainer resumes at global step {hf_step}")
            self._close(keep_arena=True)
            raise SnapshotError(
                f"cudasnap restored global step {start} from {self._dir()}, but {how}; "
                "the loop and the state would disagree (use a fresh directory to start over)")
        self.restored_step = start
        epoch = float(state.epoch or 0.0)
        if not epoch.is_integer():
            # Mid-epoch: the Trainer rebuilds and fast-forwards its data iterator first.
            self._pending_rng = _host_rng()
        log.warning("cudasnap: resumed at global step %d (epoch %.3f) from %s", start, epoch,
                    self.snapshotter.stats()["restore"]["source"])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._pending_rng is not None:
            _set_host_rng(self._pending_rng)
            self._pending_rng = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.snapshotter is not None:
            self.snapshotter.boundary(int(state.global_step) - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._end_training(self.flush_on_end)
