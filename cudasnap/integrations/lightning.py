"""PyTorch Lightning integration: ``CudaSnapCallback`` and ``ResumableDataLoader``.

Usage::

    from cudasnap.integrations.lightning import CudaSnapCallback, ResumableDataLoader

    loader = ResumableDataLoader(dataset, batch_size=32, shuffle=True)   # exact mid-epoch resume
    trainer = L.Trainer(max_epochs=3, callbacks=[CudaSnapCallback(directory="ckpt")])
    trainer.fit(model, loader)          # the same line on the first run and after a crash

Works with the ``lightning`` package (``lightning.pytorch``) and falls back to
``pytorch_lightning``.

What is snapshotted at every ``on_train_batch_end`` that followed an optimizer
step, and restored in ``on_fit_start`` (before Lightning's loops start):

* the LightningModule's parameters and buffers; every optimizer's state and
  hyper-parameters (``trainer.optimizers``);
* every LR scheduler (``trainer.lr_scheduler_configs``), the precision plugin's
  ``GradScaler`` if any, and the ``state_dict()`` of callbacks that keep state
  (ModelCheckpoint, EarlyStopping, ...) when it encodes without pickle;
* torch CPU/CUDA, numpy and ``random`` RNG states (the Snapshotter's own);
* Lightning's loop progress: ``trainer.fit_loop.state_dict()`` — the global
  step, the epoch, the batch index inside the epoch, ``_batches_that_stepped``
  and the scheduler/optimizer progress counters — loaded with
  ``fit_loop.load_state_dict()``, i.e. the path Lightning itself takes when it
  resumes from a checkpoint saved at ``on_train_batch_end``;
* the data position: Lightning saves and restores the ``state_dict()`` of any
  *stateful* train dataloader (one with ``state_dict``/``load_state_dict``, e.g.
  torchdata's ``StatefulDataLoader``) as part of the loop state.
  :class:`ResumableDataLoader` is a drop-in ``DataLoader`` that is stateful: it
  records the RNG states its iterator was created with and how many batches it
  yielded, and on resume rebuilds the same epoch order and skips the batches
  already trained on (they are loaded and dropped; no compute).

Not restored: logger and progress-bar state, ``trainer.callback_metrics``,
anything a LightningModule keeps outside its parameters/buffers (register it
through ``extra``). With a plain (non-stateful) ``DataLoader`` a resume
mid-epoch restarts that epoch's data from its first batch with a new shuffle
(Lightning warns about it): model, optimizer, counters and RNG are exact, the
data order is not. A validation run that Lightning scheduled right after the
snapshotted batch is skipped on resume (Lightning's own restart logic), and any
global-RNG draws it made are not replayed; the same holds for gradient
accumulation (snapshots are taken only at optimizer steps, so a resume redoes
the micro-batches after the last step).
"""
from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef,assignment]

from ..errors import ConfigError
from ..format import codec
from ._owner import SnapshotterOwner, default_health, env_directory

log = logging.getLogger("cudasnap.lightning")

LOADER_FORMAT = "cudasnap-resumable-loader/1"

__all__ = ["CudaSnapCallback", "ResumableDataLoader", "pl"]


# ----------------------------------------------------------------- data position
def _host_rng() -> tuple[Any, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_host_rng(state: tuple[Any, Any, Any]) -> None:
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


class ResumableDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` whose position Lightning can save and restore.

    It implements ``state_dict()``/``load_state_dict()`` (Lightning's stateful
    loader protocol). The state is small: how many batches the current iterator
    yielded, the torch RNG state (and the loader ``generator``'s state) when the
    iterator was created and when its first batch was requested — the two
    moments a ``DataLoader`` draws its shuffle seed and worker base seed.

    After ``load_state_dict`` the next ``iter()`` re-creates the iterator from
    those RNG states (same shuffle, same worker seeds), fetches and drops the
    batches already yielded, then puts the host RNG states (torch, numpy,
    random) back as they were, so training continues on the exact next batch
    with the exact RNG stream. Skipped batches are loaded (not trained on):
    this costs data-loading time, and keeps per-worker RNG streams exact.
    A saved position at or past the end of the epoch starts a fresh epoch.
    """

    def _cs_capture(self) -> tuple[Any, Any]:
        g = self.generator
        return torch.get_rng_state(), (g.get_state() if g is not None else None)

    def _cs_apply(self, rng: Any, gen: Any) -> None:
        if rng is not None:
            torch.set_rng_state(rng)
        if gen is not None and self.generator is not None:
            self.generator.set_state(gen)

    def _cs_sized_len(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None

    def __iter__(self) -> Any:
        pending = self.__dict__.pop("_cs_pending", None)
        n = self._cs_sized_len()
        skip = 0
        if pending is not None:
            want = int(pending.get("yielded", 0))
            if want > 0 and (n is None or want < n) and pending.get("rng_iter") is not None:
                skip = want
        saved = _host_rng() if skip else None
        if skip:
            self._cs_apply(pending["rng_iter"], pending.get("gen_iter"))
        rng_iter = self._cs_capture()
        inner = super().__iter__()
        if skip:
            self._cs_apply(pending.get("rng_next"), pending.get("gen_next"))
        self.__dict__.update(_cs_yielded=0, _cs_rng_iter=rng_iter, _cs_rng_next=None)
        if skip:
            self.__dict__["_cs_rng_next"] = self._cs_capture()
            done = 0
            for _ in range(skip):
                try:
                    next(inner)
                except StopIteration:
                    break
                done += 1
            self.__dict__["_cs_yielded"] = done
            assert saved is not None
            _set_host_rng(saved)  # the RNG stream continues as at the snapshot
            log.info("ResumableDataLoader: skipped %d batch(es) already trained on", done)
        return self._cs_iterate(inner)

    def _cs_iterate(self, inner: Any) -> Any:
        while True:
            if self.__dict__.get("_cs_rng_next") is None:
                self.__dict__["_cs_rng_next"] = self._cs_capture()
            try:
                batch = next(inner)
            except StopIteration:
                return
            self.__dict__["_cs_yielded"] = self.__dict__.get("_cs_yielded", 0) + 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        d = self.__dict__
        it, nx = d.get("_cs_rng_iter"), d.get("_cs_rng_next")
        return {"format": LOADER_FORMAT, "yielded": int(d.get("_cs_yielded", 0)),
                "sized": self._cs_sized_len() is not None,
                "rng_iter": it[0] if it else None, "gen_iter": it[1] if it else None,
                "rng_next": nx[0] if nx else None, "gen_next": nx[1] if nx else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != LOADER_FORMAT:
            raise ConfigError(f"ResumableDataLoader cannot load a state of format "
                              f"{state.get('format')!r}")
        self.__dict__["_cs_pending"] = dict(state)


# ------------------------------------------------------------------ loop state
class _FitLoopState:
    """``trainer.fit_loop`` as a Snapshotter ``extra`` (loaded only at fit start)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.restoring = False
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        loop = self.trainer.fit_loop
        sd = loop.state_dict()
        # A prefetching fetcher (unsized loaders only) has pulled one batch more than
        # was trained on: never skip more batches than this epoch has processed.
        processed = loop.epoch_loop.batch_progress.current.processed
        for st in (sd.get("state_dict") or {}).get("combined_loader", []) or []:
            if isinstance(st, dict) and st.get("format") == LOADER_FORMAT and not st.get("sized"):
                st["yielded"] = min(int(st["yielded"]), int(processed))
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if not self.restoring:
            log.warning("Lightning loop state not reloaded outside fit start (in-process rollback "
                        "restores tensors, optimizer and RNG only)")
            return
        self.trainer.fit_loop.load_state_dict(dict(sd))
        self.loaded = dict(sd)


# -------------------------------------------------------------------- callback
def _has_state(cb: Any) -> bool:
    return type(cb).state_dict is not Callback.state_dict


class CudaSnapCallback(SnapshotterOwner, Callback):
    """Just-in-time snapshots of a Lightning ``fit``: ≤ 1 optimizer step lost on a failure.

    Args:
        directory: snapshot directory; default ``$CUDASNAP_DIR`` or
            ``<trainer.default_root_dir>/cudasnap``.
        extra: more objects to snapshot (``state_dict``/``load_state_dict`` or
            ``torch.Generator``), e.g. state your LightningModule keeps outside tensors.
        health: health monitor, signal handlers and watchdog (default on; set
            ``CUDASNAP_HEALTH=0`` or pass False to turn it off).
        flush_on_end: write the final snapshot to disk at ``on_fit_end``, so a
            later ``fit`` on the same directory resumes from the end, never from an
            older flushed snapshot.
        **snapshotter_kwargs: passed to :class:`cudasnap.Snapshotter`.
    """

    def __init__(self, directory: str | os.PathLike | None = None,
                 extra: Mapping[str, Any] | None = None, health: bool | None = None,
                 flush_on_end: bool = True, **snapshotter_kwargs: Any) -> None:
        super().__init__()
        self.directory = directory
        self.extra = dict(extra or {})
        self.health = health
        self.flush_on_end = flush_on_end
        self.snapshotter_kwargs = snapshotter_kwargs
        self.snapshotter: Any = None
        self.restored_step: int | None = None  # global step resumed at (None: fresh run)
        self.last_stats: dict[str, Any] | None = None  # Snapshotter.stats() at close
        self._loops: _FitLoopState | None = None
        self._last_global_step = -1

    # Lightning stores callback state in its own checkpoints under this key.
    @property
    def state_key(self) -> str:
        return f"CudaSnapCallback[{self.directory}]"

    def _resolve_dir(self, trainer: Any) -> str:
        if self.directory is not None:
            return str(self.directory)
        return env_directory() or os.path.join(trainer.default_root_dir, "cudasnap")

    def _extras(self, trainer: Any) -> dict[str, Any]:
        assert self._loops is not None
        extras: dict[str, Any] = {"lightning.fit_loop": self._loops}
        for i, cfg in enumerate(getattr(trainer, "lr_scheduler_configs", []) or []):
            sch = cfg.scheduler
            if callable(getattr(sch, "state_dict", None)):
                extras[f"lightning.lr_scheduler.{i}"] = sch
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and callable(getattr(scaler, "state_dict", None)):
            extras["lightning.grad_scaler"] = scaler
        for cb in trainer.callbacks:
            if cb is self or not _has_state(cb):
                continue
            try:
                codec.encode(cb.state_dict(), "callback")
            except ConfigError as e:
                log.warning("callback %s not snapshotted: %s", cb.state_key, e)
                continue
            extras[f"lightning.callback.{cb.state_key}"] = cb
        for k, v in self.extra.items():
            if k in extras:
                raise ConfigError(f"extra key {k!r} is reserved by CudaSnapCallback")
            extras[k] = v
        return extras

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from ..snapshotter import Snapshotter

        if self.snapshotter is not None:
            return
        opts = list(trainer.optimizers)
        optimizer: Any = None
        if len(opts) == 1:
            optimizer = opts[0]
        elif opts:
            optimizer = {f"optim{i}": o for i, o in enumerate(opts)}
        health = default_health(self.health)
        self._loops = _FitLoopState(trainer)
        self.snapshotter = Snapshotter(pl_module, optimizer, self._resolve_dir(trainer),
                                       extra=self._extras(trainer), health=health,
                                       **self.snapshotter_kwargs)
        self._loops.restoring = True
        try:
            start = self.snapshotter.restore_latest()
        finally:
            self._loops.restoring = False
        if start > 0:
            if getattr(trainer, "ckpt_path", None):
                log.warning("cudasnap: fit(ckpt_path=%s) given as well: Lightning's checkpoint, "
                            "loaded after on_fit_start, overrides the cudasnap snapshot",
                            trainer.ckpt_path)
            self.restored_step = trainer.global_step
            log.warning("cudasnap: resumed at global step %d, epoch %d, batch %d of the epoch "
                        "(snapshot of step %d, from %s)", trainer.global_step, trainer.current_epoch,
                        trainer.fit_loop.epoch_loop.batch_progress.current.processed, start - 1,
                        self.snapshotter.stats()["restore"]["source"])
        self._last_global_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        snap = self.snapshotter
        if snap is None:
            return
        gs = trainer.global_step
        if gs == self._last_global_step:  # accumulating gradients, or a skipped step
            return
        self._last_global_step = gs
        snap.boundary(gs - 1)  # step index of the optimizer step just taken

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_training(self.flush_on_end)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        snap = self.snapshotter
        if snap is None:
            return
        try:
            if snap.guard is not None:
                snap.guard.on_exception(exception)
        finally:
            self._close(keep_arena=True)  # the supervisor or the next process uses it

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close()
