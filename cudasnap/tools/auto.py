"""Transparent mode: protect a training script that has no cudasnap code.

``cudasnap run --auto -- python train.py`` loads this module in the child.
A global optimizer-step post-hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``) finds, at the first ``step()`` of each
optimizer, the ``nn.Module``\\ s that own its parameters (one scan of live
objects) and starts a :class:`~cudasnap.Snapshotter` for them; every later
``step()`` is a boundary. On a failure the supervisor flushes the newest
snapshot; ``cudasnap export DIR --to torch FILE`` turns it into a
``state_dict`` file the script's own resume path can load.

What this mode does NOT give: bitwise resume. The script's loop counter, data
position, scheduler and RNG use between steps are the script's own; only the
two-line integration (``Snapshotter`` + ``restore_latest()``) resumes bit for bit.

So each run's snapshots are numbered by that run's own optimizer steps, from 0: a
restarted script trains again from its own start, and its snapshots must not read as a
continuation of the run before (issue 44: ``step-00000060`` held a fresh run's 41 steps).
The first Snapshotter of a process starts fresh: the previous run's snapshots (with the
newest one of its arena) move aside to ``DIR/.old-<UTC time>/``, nothing deleted, where
``cudasnap export DIR/.old-<time> --to torch FILE`` still reads them. ``cudasnap run
--auto`` lets the dead attempt's flush finish before it restarts, so it lands there too.
"""
from __future__ import annotations

import atexit
import gc
import logging
import warnings
import weakref
from typing import Any

from ..config import Settings

log = logging.getLogger("cudasnap.auto")

_state: dict[int, Any] = {}
_handle: Any = None
_health = True


def _live_modules() -> list[Any]:
    """Every nn.Module the garbage collector tracks. Weak proxies are skipped: a dead
    one raises ReferenceError on the isinstance check (torch.compile leaves some), and
    a live one stands for a module that is in the list itself."""
    import torch

    proxies = (weakref.ProxyType, weakref.CallableProxyType)
    # isinstance() on every live object touches deprecated lazy attributes of modules in
    # the heap (torch.distributed's reduce_op warns): the scan is ours, not the script's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [m for m in gc.get_objects()
                if type(m) not in proxies and isinstance(m, torch.nn.Module)]


def _owning_modules(opt: Any) -> dict[str, Any]:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    owners = [m for m in _live_modules()
              if any(id(p) in params for p in m.parameters(recurse=True))]
    children = {id(c) for m in owners for c in m.modules() if c is not m}
    roots = [m for m in owners if id(m) not in children]
    roots.sort(key=lambda m: -sum(1 for _ in m.parameters()))
    return {("model" if i == 0 else f"model{i}"): m for i, m in enumerate(roots)}


def _post_step(opt: Any, args: Any, kwargs: Any) -> None:
    entry = _state.get(id(opt))
    if entry is None:
        from ..snapshotter import Snapshotter

        models = _owning_modules(opt)
        if not models:
            log.warning("transparent mode: no nn.Module owns %s's parameters; not protected",
                        type(opt).__name__)
            _state[id(opt)] = False
            return
        key = "optim" if not _state else f"optim{len(_state)}"
        first = not _state
        snap = Snapshotter(models, {key: opt}, job=None if first else f"auto{len(_state)}",
                           health=_health, fresh=first)  # this run's steps, from 0 (above)
        entry = _state[id(opt)] = {"snap": snap, "step": 0}
        log.warning("transparent mode: protecting %s (%s) with cudasnap", type(opt).__name__,
                    ", ".join(f"{k}={type(m).__name__}" for k, m in models.items()))
    if entry is False:
        return
    entry["snap"].boundary(entry["step"])
    entry["step"] += 1


def install() -> None:
    """Registers the global optimizer-step hook (idempotent)."""
    global _handle
    if _handle is not None:
        return

    from torch.optim.optimizer import register_optimizer_step_post_hook

    global _health
    # The guard is on unless CUDASNAP_HEALTH says 0 (read, and checked, once: now).
    _health = Settings.from_env().health is not False
    _handle = register_optimizer_step_post_hook(_post_step)
    atexit.register(_close_all)
    log.info("cudasnap transparent mode installed")


def _close_all() -> None:
    for snap in snapshotters():
        try:
            snap.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("closing %s failed", snap)


def snapshotters() -> list[Any]:
    return [e["snap"] for e in _state.values() if e]
