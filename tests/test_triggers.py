"""Tests for cudasnap.triggers: policy, signals, watchdog, exception hooks, dispatcher."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import pytest

from cudasnap import triggers
from cudasnap.health import Trigger
from cudasnap.triggers import (
    EXIT_GPU_FAULT,
    EXIT_GPU_LOST,
    EXIT_HANG,
    EXIT_PEER_FAILURE,
    EXIT_PREEMPTED,
    Action,
    Dispatcher,
    Policy,
    Watchdog,
    guard,
    install_excepthook,
    install_signal_handlers,
)

A = Action


@pytest.fixture(autouse=True)
def _no_env_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)


def test_exit_codes() -> None:
    assert (EXIT_GPU_LOST, EXIT_GPU_FAULT, EXIT_HANG, EXIT_PREEMPTED, EXIT_PEER_FAILURE) == (75, 76, 77, 78, 79)


@pytest.mark.parametrize("trig,expected", [
    (Trigger("xid", code=79), (A.FLUSH_AND_EXIT, 76)), (Trigger("xid", code=48), (A.FLUSH_AND_EXIT, 76)),
    (Trigger("xid", code=13), (A.FLUSH, None)), (Trigger("xid", code=31), (A.FLUSH, None)),
    (Trigger("xid", code=62), (A.LOG, None)),
    (Trigger("ecc_dbe"), (A.FLUSH_AND_EXIT, 76)), (Trigger("ecc_uncorrected"), (A.FLUSH_AND_EXIT, 76)),
    (Trigger("remap_failure"), (A.FLUSH_AND_EXIT, 76)), (Trigger("recovery_action"), (A.FLUSH_AND_EXIT, 76)),
    (Trigger("remap_pending"), (A.FLUSH, None)), (Trigger("gpu_lost"), (A.FLUSH_AND_EXIT, 75)),
    (Trigger("thermal"), (A.LOG, None)), (Trigger("sigterm"), (A.FLUSH_AND_EXIT, 78)),
    (Trigger("sigusr1"), (A.FLUSH, None)), (Trigger("hang"), (A.FLUSH_AND_EXIT, 77)),
    (Trigger("exception"), (A.FLUSH, None)), (Trigger("manual"), (A.FLUSH, None)),
    (Trigger("peer_failure"), (A.FLUSH_AND_EXIT, 79)),
])
def test_policy_defaults(trig: Trigger, expected: tuple[Action, int | None]) -> None:
    assert Policy().decide(trig) == expected


def test_policy_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDASNAP_POLICY", "thermal=flush, sigusr1=flush_exit,xid.other=flush;hang=flush_exit:90")
    p = Policy.from_env()
    assert p.decide(Trigger("thermal")) == (A.FLUSH, None)
    assert p.decide(Trigger("sigusr1")) == (A.FLUSH_AND_EXIT, 78)
    assert p.decide(Trigger("xid", code=62)) == (A.FLUSH, None)
    assert p.decide(Trigger("xid", code=79)) == (A.FLUSH_AND_EXIT, 76)   # untouched
    assert p.decide(Trigger("hang")) == (A.FLUSH_AND_EXIT, 90)
    q = Policy.from_env({"CUDASNAP_POLICY": "xid=ignore,gpu_lost=log"})
    assert q.decide(Trigger("xid", code=79)) == (A.IGNORE, None)
    assert q.decide(Trigger("gpu_lost")) == (A.LOG, None)
    assert Policy.from_env({}).rules == Policy().rules


@pytest.mark.parametrize("spec,entry", [
    ("thermal=explode", "thermal=explode"), ("bogus=flush", "bogus=flush"), ("thermal", "thermal"),
    ("ecc_dbe=flush, hang=flush:3", "hang=flush:3"), ("hang=flush_exit:x", "hang=flush_exit:x"),
    ("xid.weird=log", "xid.weird=log"),
])
def test_policy_env_errors(spec: str, entry: str) -> None:
    with pytest.raises(ValueError) as ei:
        Policy.from_env({"CUDASNAP_POLICY": spec})
    assert repr(entry) in str(ei.value) and "CUDASNAP_POLICY" in str(ei.value)


# ----------------------------------------------------------------------------- dispatcher

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


# ----------------------------------------------------------------------------- watchdog

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


# ----------------------------------------------------------------------------- exceptions

def test_excepthook_calls_callback_then_previous(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    got: list[Trigger] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: order.append("prev_sys"))
    monkeypatch.setattr(threading, "excepthook", lambda args: order.append("prev_thread"))
    hooks = install_excepthook(lambda t: (got.append(t), order.append("cb")))
    try:
        try:
            raise ValueError("boom")
        except ValueError as exc:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        th = threading.Thread(target=lambda: 1 / 0, name="worker-7")
        th.start()
        th.join()
    finally:
        hooks.uninstall()
    assert order == ["cb", "prev_sys", "cb", "prev_thread"]
    assert got[0].kind == "exception" and got[0].detail == "ValueError: boom"
    assert got[1].detail.startswith("ZeroDivisionError") and "worker-7" in got[1].detail
    assert sys.excepthook is not hooks.sys_hook


def test_guard_calls_callback_and_reraises(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[Trigger] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    with pytest.raises(RuntimeError, match="bad step"):
        with guard(got.append):
            raise RuntimeError("bad step")
    assert [t.detail for t in got] == ["RuntimeError: bad step"]
    with guard(got.append):
        pass
    with pytest.raises(SystemExit):
        with guard(got.append):
            raise SystemExit(0)
    assert len(got) == 1
    # The same exception reaching sys.excepthook later is not reported twice.
    hooks = install_excepthook(got.append)
    try:
        try:
            with guard(lambda t: None):
                raise KeyError("k")
        except KeyError as exc:
            sys.excepthook(KeyError, exc, None)
    finally:
        hooks.uninstall()
    assert len(got) == 1


# ----------------------------------------------------------------------------- signals

def _wait(cond: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_signal_handler_chains_previous_and_uninstalls() -> None:
    order: list[str] = []
    prev = signal.signal(signal.SIGUSR1, lambda s, f: order.append("prev"))
    try:
        h = install_signal_handlers(lambda t: order.append(f"cb:{t.kind}:{t.code}"), signals=(signal.SIGUSR1,))
        assert h.installed == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: len(order) >= 2)
        assert order == [f"cb:sigusr1:{int(signal.SIGUSR1)}", "prev"]
        h.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: len(order) >= 3)
        assert order[-1] == "prev"
    finally:
        signal.signal(signal.SIGUSR1, prev)


def test_sigterm_with_default_handler_terminates_after_callback() -> None:
    events: list[Any] = []
    prev = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        # Policy maps sigterm to plain flush, so the dispatcher does not exit; SIG_DFL semantics must.
        d = Dispatcher(lambda t: events.append("flushed") or "/p", policy=Policy.parse("sigterm=flush"),
                       exit_fn=lambda c: events.append(("dispatcher_exit", c)))
        h = install_signal_handlers(d.handle, exit_fn=lambda c: events.append(("exit", c)))
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(lambda: len(events) >= 2)
        h.uninstall()
    finally:
        signal.signal(signal.SIGTERM, prev)
    assert events == ["flushed", ("exit", 78)]


def test_install_from_non_main_thread_skips(caplog: pytest.LogCaptureFixture) -> None:
    out: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="cudasnap.triggers"):
        th = threading.Thread(target=lambda: out.append(install_signal_handlers(lambda t: None)))
        th.start()
        th.join()
    assert out[0].installed == [] and "not the main thread" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not out[0]._handler
    assert triggers.ENV_POLICY == "CUDASNAP_POLICY"
