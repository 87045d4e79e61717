"""Tests for cudasnap.triggers.watchdog."""

from __future__ import annotations

import threading
import time

import pytest

from cudasnap.triggers.dispatch import Dispatcher
from cudasnap.triggers.policy import (
    Action,
)
from cudasnap.triggers.watchdog import Watchdog

A = Action


@pytest.fixture(autouse=True)
def _no_env_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)


def test_watchdog_fires_once_on_stall() -> None:
    fired: list[float] = []
    ev = threading.Event()
    wd = Watchdog(0.15, lambda s: (fired.append(s), ev.set()), poll_s=0.01)
    wd.start()
    try:
        time.sleep(0.25)
        assert fired == []                               # not armed before the first kick
        t0 = time.monotonic()
        wd.kick(step=5)
        assert ev.wait(2)
        assert time.monotonic() - t0 >= 0.15 and fired[0] >= 0.15 and wd.last_step == 5
        time.sleep(0.05)
        assert len(fired) == 1 and wd.fired
    finally:
        wd.stop()


def test_watchdog_quiet_on_slow_but_live_loop_and_when_paused() -> None:
    fired: list[float] = []
    wd = Watchdog(0.2, fired.append, poll_s=0.01)
    try:
        for step in range(8):                            # 0.08 s per step, limit 0.2 s
            wd.kick(step)
            time.sleep(0.08)
        with wd.paused():
            time.sleep(0.3)
        wd.kick(9)
        time.sleep(0.05)
        assert fired == []
    finally:
        wd.stop()
    with pytest.raises(ValueError):
        Watchdog(0, fired.append)


def test_watchdog_with_dispatcher_exits_77() -> None:
    ex = ExitRecorder()
    d = Dispatcher(lambda t: "/ckpt/h", exit_fn=ex)
    wd = Watchdog(0.05, d.on_hang, poll_s=0.005)
    wd.kick(1)
    deadline = time.monotonic() + 2
    while not ex.codes and time.monotonic() < deadline:
        time.sleep(0.005)
    wd.stop()
    assert ex.codes == [77] and d.history[0].trigger.kind == "hang"


class ExitRecorder:
    def __init__(self, flush_done: threading.Event | None = None) -> None:
        self.codes: list[int] = []
        self.flush_done_at_exit: list[bool] = []
        self.flush_done = flush_done

    def __call__(self, code: int) -> None:
        self.flush_done_at_exit.append(self.flush_done.is_set() if self.flush_done else True)
        self.codes.append(code)
