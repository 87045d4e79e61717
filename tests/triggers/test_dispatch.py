"""Tests for cudasnap.triggers.dispatch: one flush at a time, coalescing, dedup, exit."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from cudasnap.triggers.dispatch import Dispatcher
from cudasnap.triggers.kinds import Trigger
from cudasnap.triggers.policy import (
    Action,
    Policy,
)

A = Action


@pytest.fixture(autouse=True)
def _no_env_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)


class ExitRecorder:
    def __init__(self, flush_done: threading.Event | None = None) -> None:
        self.codes: list[int] = []
        self.flush_done_at_exit: list[bool] = []
        self.flush_done = flush_done

    def __call__(self, code: int) -> None:
        self.flush_done_at_exit.append(self.flush_done.is_set() if self.flush_done else True)
        self.codes.append(code)


def test_flush_completes_before_exit() -> None:
    done = threading.Event()

    def flush(t: Trigger) -> str:
        time.sleep(0.15)
        done.set()
        return "/ckpt/step-40"

    ex = ExitRecorder(done)
    d = Dispatcher(flush, exit_fn=ex)
    assert d.handle(Trigger("xid", code=79, device=0)) == "/ckpt/step-40"
    assert ex.codes == [76] and ex.flush_done_at_exit == [True]
    assert [(e.action, e.result, e.outcome) for e in d.history] == [(A.FLUSH_AND_EXIT, "/ckpt/step-40", "flushed")]


def test_exit_waits_for_flush_running_in_another_thread() -> None:
    done = threading.Event()
    started = threading.Event()
    calls: list[str] = []

    def flush(t: Trigger) -> str:
        calls.append(t.kind)
        started.set()
        time.sleep(0.2)
        done.set()
        return "/ckpt/a"

    ex = ExitRecorder(done)
    d = Dispatcher(flush, exit_fn=ex)
    th = threading.Thread(target=d.handle, args=(Trigger("sigusr1"),))
    th.start()
    assert started.wait(2)
    d.handle(Trigger("gpu_lost", device=1))              # arrives mid-flush: waits, no second flush
    th.join()
    assert calls == ["sigusr1"] and ex.codes == [75] and ex.flush_done_at_exit == [True]
    assert {e.outcome for e in d.history} == {"flushed", "coalesced"}


def test_concurrent_triggers_one_flush() -> None:
    n = 8
    calls: list[Trigger] = []
    barrier = threading.Barrier(n)

    def flush(t: Trigger) -> str:
        calls.append(t)
        time.sleep(0.2)
        return "/ckpt/x"

    d = Dispatcher(flush, exit_fn=ExitRecorder())
    results: list[Any] = []

    def worker(i: int) -> None:
        barrier.wait()
        results.append(d.handle(Trigger("remap_pending", device=i)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == ["/ckpt/x"] * n
    c = d.counts()
    assert c["triggers"] == n and c["flushes"] == 1 and c["coalesced"] == n - 1 and c["kind.remap_pending"] == n


def test_duplicates_within_window_are_dropped() -> None:
    calls: list[Trigger] = []
    d = Dispatcher(lambda t: calls.append(t) or None, exit_fn=ExitRecorder(), dedup_s=0.1)
    t = Trigger("manual", detail="x")
    d.handle(t)
    d.handle(Trigger("manual", detail="x"))
    assert len(calls) == 1 and d.counts()["duplicates"] == 1
    d.handle(Trigger("manual", device=3))                # different device: not a duplicate
    time.sleep(0.12)
    d.handle(t)
    assert len(calls) == 3


def test_flush_error_still_exits(caplog: pytest.LogCaptureFixture) -> None:
    def flush(t: Trigger) -> str:
        raise OSError("disk full")

    ex = ExitRecorder()
    d = Dispatcher(flush, exit_fn=ex)
    with caplog.at_level(logging.ERROR, logger="cudasnap.triggers"):
        assert d.handle(Trigger("ecc_dbe", device=0)) is None
    assert ex.codes == [76]
    assert d.history[-1].outcome == "flush_failed" and d.counts()["flush_errors"] == 1
    rec = [r for r in caplog.records if "flush for ecc_dbe failed" in r.getMessage()]
    assert rec and rec[0].exc_info is not None and "disk full" in caplog.text


def test_log_and_ignore_do_not_flush_and_step_fn() -> None:
    calls: list[Trigger] = []
    d = Dispatcher(lambda t: calls.append(t) or "p", policy=Policy.parse("thermal=ignore"),
                   exit_fn=ExitRecorder(), step_fn=lambda: 17)
    d.handle(Trigger("thermal"))
    d.handle(Trigger("xid", code=62))
    assert calls == [] and [e.outcome for e in d.history] == ["ignored", "logged"]
    d.manual("user asked")
    assert calls[0].step == 17 and calls[0].kind == "manual"
    d2 = Dispatcher(lambda t: calls.append(t) or "p", exit_fn=ExitRecorder(), step_fn=lambda: 17)
    d2.handle(Trigger("manual", step=3))
    assert calls[-1].step == 3                           # source-provided step wins


def test_reentrant_trigger_during_flush_is_deferred_then_exits() -> None:
    ex = ExitRecorder()
    d: Dispatcher

    def flush(t: Trigger) -> str:
        # e.g. SIGTERM handler running in this same thread during a SIGUSR1 flush
        assert d.handle(Trigger("sigterm")) is None
        assert ex.codes == []
        return "/ckpt/r"

    d = Dispatcher(flush, exit_fn=ex)
    assert d.handle(Trigger("sigusr1")) == "/ckpt/r"
    assert ex.codes == [78] and d.counts()["deferred"] == 1
