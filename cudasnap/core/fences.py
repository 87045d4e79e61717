"""Fences: no write of the state overtakes the running snapshot copy.

The copy of step N runs in the background. Every writer of the state waits for
the phase of that copy it would overwrite: the optimizer's step pre-hook and
``load_state_dict`` pre-hook (phase 1: parameters and optimizer state), the
forward pre-hook of every module owning buffers (phase 0: buffers), and the
explicit ``Snapshotter.fence()``. A wait longer than ``wait_timeout_s``
abandons that snapshot (logged), so a stalled copier never hangs training.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import SnapshotError
from .shared import Fields

log = logging.getLogger("cudasnap")


class FencesMixin(Fields):
    def _install_fences(self) -> None:
        for opt in self.state.optimizers.values():
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self._fence(1)))
            self._hooks.append(opt.register_load_state_dict_pre_hook(self._before_load))
            self._hooks.append(opt.register_load_state_dict_post_hook(
                lambda *_: self.invalidate_layout()))
        for mod in self.state.models.values():
            seen = set()
            for sub in [mod, *[m for m in mod.modules() if any(True for _ in m.buffers(False))]]:
                if id(sub) not in seen:
                    seen.add(id(sub))
                    self._hooks.append(sub.register_forward_pre_hook(lambda *_: self._fence(0)))

    def _before_load(self, *_: Any) -> None:
        self._fence(1)  # never let load_state_dict race a running copy

    def fence(self) -> None:
        """Orders the caller's next writes of the state after the running copy.

        Call it before writing state tensors in a way the optimizer-step and
        forward hooks do not see: an EMA ``lerp_``/``copy_`` outside
        ``optimizer.step()``, manual edits, a CUDA-graph replay of the step.
        CUDA backend: the current stream waits on the copy (no host block);
        CPU backend: a host wait. A no-op when no copy is running. A wait longer
        than ``wait_timeout_s`` abandons that snapshot (logged) instead of hanging.
        """
        self._fence(1)

    def _fence(self, phase: int) -> None:
        # Every caller is about to write the state: the live state is no longer the
        # last boundary's. Set before the check below (a flush reads it the other way).
        self._live_dirty = True
        ev = self._live_copy
        if ev is not None:  # a flush copies the live state right now: let it finish
            ev.wait(self.wait_timeout_s)
        job = self._job
        if job is None or self._fenced[phase]:
            return
        t0 = time.perf_counter_ns()
        stream = self._cuda.current_stream() if self._cuda is not None else 0
        if not self._engine.fence(job, phase, stream):
            self._stats["abandoned"] += 1
            log.error("snapshot of step %d abandoned: its copy did not reach phase %d within "
                      "%.0f s (copier stalled or GPU hung); the previous snapshot stays the "
                      "newest", job.step, phase, self.wait_timeout_s)
        self._fenced[phase] = True
        if phase == 1:
            self._fenced[0] = True
        self._stats["fence_wait_ns"] += time.perf_counter_ns() - t0

    def _wait_job(self, timeout: float | None = None) -> bool:
        job = self._job
        if job is None:
            return True
        t0 = time.perf_counter_ns()
        try:
            ok = job.wait(1, -1.0 if timeout is None else timeout)
        except SnapshotError as e:
            log.error("snapshot of step %d failed: %s", job.step, e)
            ok = True
        self._stats["fence_wait_ns"] += time.perf_counter_ns() - t0
        if ok:
            secs = job.seconds_to_complete
            self._stats["last_copy_seconds"] = secs
            if secs and secs > 0:
                self._stats["last_copy_gbps"] = job.bytes / secs / 1e9
            # Another thread (a flush) may wait too: retire only the job we waited on.
            with self._slot_lock:
                if self._job is job:
                    self._job = None
                    self._job_layout = None
                    self._fenced = [True, True]
        return ok

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the running snapshot is COMPLETE (True) or the timeout passes."""
        return self._wait_job(timeout)
