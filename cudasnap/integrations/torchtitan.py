"""cudasnap as torchtitan's checkpoint manager (torchtitan 0.3.0, package ``torchtitan``).

torchtitan's ``Trainer`` builds its checkpointer from ``config.checkpoint`` with every object
a resume needs and calls it at fixed points of ``train()``: ``load()`` before the loop (the
data iterator is made after it), ``save(step)`` after each step's optimizer and LR-scheduler
step, ``close()`` at the end. ``CudaSnapCheckpointManager`` is that checkpointer: no line of
the trainer changes, a config function picks it::

    from torchtitan.models.llama3.config_registry import llama3_8b
    from cudasnap.integrations.torchtitan import CudaSnapCheckpointManager

    def llama3_8b_cudasnap():
        cfg = llama3_8b()
        cfg.checkpoint = CudaSnapCheckpointManager.Config(enable=True)
        return cfg

(``--module my_cfg --config llama3_8b_cudasnap``.) What it snapshots, at every ``save``:

* the model parts' parameters and buffers (FSDP2 / TP local shards, the fused ``wqkv``
  parameter itself, never the split copies its ``state_dict`` hook makes),
* the optimizer state of every optimizer the ``OptimizersContainer`` steps,
* ``lr_scheduler`` (the ``LRSchedulersContainer``), ``dataloader`` (each rank's position:
  ``dp_rank_<N>``), ``train_state`` (the Trainer's ``step`` and ``ntokens_seen``), RNG states.

``load()`` restores the newest snapshot every rank holds (shared memory first, then disk)
and sets ``trainer.step`` to its step, so the loop goes on at the next one; torchtitan's
steps count from 1 and are used as they are. The RNG states go back once more at the
first forward after the load (``rng_restore``: torchtitan makes its data iterator after
``load()``, and ``iter()`` of its dataloader draws from the CPU generator).

The durable tier: every ``--checkpoint.interval`` steps (torchtitan's own flag, default
500) every rank flushes the newest snapshot in the background, a committed step on disk
that survives the loss of the node's memory; at the last step every rank flushes and
waits. ``close()`` on torchtitan's exception path (``main()`` calls ``trainer.close()`` in
its ``except``: a peer's death makes gloo raise on the survivors) keeps the arena, so the
restart resumes from it (``Snapshotter.close``). Run it under
``cudasnap run -- torchrun --max-restarts=0 ...`` (see README, "torchtitan").
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpointer import BaseCheckpointManager

from ..config import Settings
from ..core import module_state
from ..snapshotter import Snapshotter

log = logging.getLogger("cudasnap.torchtitan")


def _fused_qkv_views(m: Any) -> dict[str, dict[str, Any]]:
    """FusedQKVLinear's ``wqkv`` as its state_dict hook splits it (cudasnap.tools.dcp_views),
    so ``cudasnap export --to dcp`` holds the ``wq``/``wk``/``wv`` keys torchtitan's
    CheckpointManager asks for."""
    out = {}
    for param in ("weight", "bias"):
        if getattr(m.wqkv, param, None) is not None:
            out[f"wqkv.{param}"] = {"kind": "fused_qkv", "head_dim": int(m.head_dim),
                                    "heads_per_kv": int(m.heads_per_kv),
                                    "names": [f"{w}.{param}" for w in ("wq", "wk", "wv")]}
    return out


try:
    from torchtitan.models.common.attention import FusedQKVLinear
except ImportError:  # another torchtitan layout: its export keeps the fused name (and says so)
    log.debug("torchtitan without FusedQKVLinear: no export views registered")
else:
    module_state.register_views(FusedQKVLinear, _fused_qkv_views)


class CudaSnapCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan checkpoint manager backed by a cudasnap ``Snapshotter`` (module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        folder: str = "cudasnap"
        """Snapshot directory, relative to the trainer's dump folder (or absolute);
        ``$CUDASNAP_DIR`` (set by ``cudasnap run``) wins."""

        snapshot_every: int = 0
        """Copy every k-th step to host memory (a trigger still saves the live state);
        0: the overhead budget (``$CUDASNAP_OVERHEAD_BUDGET``, 1%) picks k."""

        initial_load_model_only: bool = False
        """(torchtitan's; cudasnap loads no initial checkpoint: off, so torchtitan does
        not warn that it has no effect.)"""

        flush_timeout_s: float = 120.0
        """Bound of the waits of each interval flush (the data write itself is never cut)."""

    def __init__(self, config: Any, *, dataloader: Any, model_parts: list[Any],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = bool(config.enable)
        self.save_future = None
        if not self.enable:
            return
        models = ({"model": model_parts[0]} if len(model_parts) == 1 else
                  {f"model.{i}": m for i, m in enumerate(model_parts)})
        extra: dict[str, Any] = {"lr_scheduler": lr_schedulers, **states}
        if dataloader is not None:
            extra["dataloader"] = dataloader
        directory = Settings.from_env().directory or os.path.join(base_folder, config.folder)
        self.snap = Snapshotter(models, optimizers, directory=directory, extra=extra,
                                snapshot_every=config.snapshot_every or None)
        self.restored: int | None = None
        self.interval = int(config.interval)
        self.flush_timeout_s = float(config.flush_timeout_s)
        self._flusher: threading.Thread | None = None

    def _load(self, step: int = -1) -> bool:
        if step != -1:
            log.warning("cudasnap restores the newest snapshot; step %d asked for is ignored",
                        step)
        start = self.snap.restore_latest()
        self.restored = start - 1 if start else None
        return bool(start)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        self.snap.boundary(curr_step)
        if last_step:
            self._join_flush()
            self.snap.flush()  # every rank reaches the last step: a committed snapshot
        elif self.interval > 0 and curr_step % self.interval == 0:
            self._flush_in_background(curr_step)
        return True

    def _flush_in_background(self, step: int) -> None:
        """The durable tier: a committed flush of the newest snapshot on a thread of its
        own (every rank starts it at the same step; the flush round agrees on the step).
        One at a time: a flush still running when the next interval comes is not doubled."""
        if self._flusher is not None and self._flusher.is_alive():
            log.warning("cudasnap: the flush of an earlier interval still runs at step %d: "
                        "no second one (a longer --checkpoint.interval fits this disk)", step)
            return

        def run() -> None:
            try:
                path = self.snap.flush(wait=True, timeout=self.flush_timeout_s)
                log.info("cudasnap: interval flush at step %d: %s", step, path)
            except Exception as e:  # noqa: BLE001 - the snapshots in memory stay
                log.error("cudasnap: the interval flush at step %d failed: %s", step, e)

        self._flusher = threading.Thread(target=run, name=f"cudasnap-interval-{step}",
                                         daemon=True)
        self._flusher.start()

    def _join_flush(self) -> None:
        t, self._flusher = self._flusher, None
        if t is not None:
            t.join(self.flush_timeout_s + 60.0)

    def _maybe_wait_for_staging(self) -> None:
        pass  # the optimizer's step pre-hook fences the running copy

    def _wait_for_saving(self) -> None:
        pass

    def _close(self) -> None:
        self._join_flush()
        self.snap.close()  # on torchtitan's exception path it keeps the arena
