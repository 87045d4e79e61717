"""The CPU copy workers use spare cycles only: they must never preempt the training
thread when a copy is handed to them (issue 15 target 2).

With plain ``nice 10`` a worker woken by ``submit()`` still preempted the trainer
(wake-up preemption): on the loaded 2-core VM ``_C.submit`` took 6-10 ms wall for
0.1 ms of CPU at 40,000 tensors, the trainer waiting on the run queue while the
worker copied. SCHED_BATCH workers are never woken ahead of a running SCHED_OTHER
thread but keep their CPU share (unlike SCHED_IDLE, which a busy host can starve).
"""
from __future__ import annotations

import os
import time

import pytest


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _settled(tids: set[int], want_policy: int, want_nice: int) -> dict[int, tuple[int, int]]:
    """Each worker's (policy, nice) once every one has set its own (they do so at start)."""
    got: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = {t: (os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids}
        if all(v == (want_policy, want_nice) for v in got.values()):
            break
        time.sleep(0.01)
    return got


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies only")
def test_copy_workers_are_batch_scheduled_at_nice_10(native_C):
    before = _tasks()
    eng = native_C.CpuCopyEngine(2)
    try:
        workers = _tasks() - before
        assert len(workers) == 2, workers
        got = _settled(workers, os.SCHED_BATCH, 10)
        assert all(v == (os.SCHED_BATCH, 10) for v in got.values()), got
        # The training thread itself is left alone.
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        eng.shutdown(10)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies only")
def test_nice_0_workers_keep_the_training_threads_policy(native_C):
    before = _tasks()
    eng = native_C.CpuCopyEngine(1, 0)
    try:
        workers = _tasks() - before
        assert len(workers) == 1, workers
        got = _settled(workers, os.SCHED_OTHER, 0)
        assert all(v == (os.SCHED_OTHER, 0) for v in got.values()), got
    finally:
        eng.shutdown(10)
