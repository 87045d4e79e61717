"""Tests for cudasnap.triggers.signals: the one signal path (C self-pipe -> one thread)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import pytest

from cudasnap import triggers
from cudasnap.triggers.dispatch import Dispatcher
from cudasnap.triggers.kinds import Trigger
from cudasnap.triggers.policy import (
    Action,
    Policy,
)
from cudasnap.triggers.signals import install_signal_handlers

A = Action


@pytest.fixture(autouse=True)
def _no_env_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)


def _wait(cond: Any, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_signal_handler_chains_previous_and_uninstalls() -> None:
    order: list[str] = []
    threads: list[str] = []
    prev = signal.signal(signal.SIGUSR1, lambda s, f: order.append("prev"))

    def cb(t: Trigger) -> None:
        threads.append(threading.current_thread().name)
        order.append(f"cb:{t.kind}:{t.code}")

    try:
        h = install_signal_handlers(cb, signals=(signal.SIGUSR1,))
        assert h.installed == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: len(order) >= 2)
        # The C handler chains the previous (Python) handler, which runs on the main thread
        # while the callback runs on the pipe's thread: both run, in no fixed order.
        assert sorted(order) == sorted([f"cb:sigusr1:{int(signal.SIGUSR1)}", "prev"])
        assert threads == ["cudasnap-signals"]
        h.uninstall()
        h.join(5.0)
        assert h.installed == []
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: len(order) >= 3)
        assert order[-1] == "prev" and len(order) == 3
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
        h.join(5.0)
    finally:
        signal.signal(signal.SIGTERM, prev)
    assert events == ["flushed", ("exit", 78)]


def test_install_from_a_worker_thread_works() -> None:
    """The pipe needs no main thread (the removed Python-handler path could not do this)."""
    got: list[str] = []
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(install_signal_handlers(
        lambda t: got.append(t.kind), signals=(signal.SIGUSR1,))))
    th.start()
    th.join()
    try:
        assert out[0].installed == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: got == ["sigusr1"])
        assert got == ["sigusr1"]
    finally:
        out[0].uninstall()
        out[0].join(5.0)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert triggers.ENV_POLICY == "CUDASNAP_POLICY"


def test_two_registrations_share_one_pipe_and_reinstall_after_uninstall() -> None:
    a: list[str] = []
    b: list[str] = []
    ha = install_signal_handlers(lambda t: a.append(t.kind), signals=(signal.SIGUSR1,))
    hb = install_signal_handlers(lambda t: b.append(t.kind), signals=(signal.SIGUSR1,))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: a and b)
        assert (a, b) == (["sigusr1"], ["sigusr1"])  # one reader thread calls both
        hb.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: len(a) == 2)
        assert (len(a), len(b)) == (2, 1)
    finally:
        ha.uninstall()
        hb.uninstall()
        ha.join(5.0)
    # A fresh pipe (possibly with the same fd number) gets a fresh reader thread.
    for _ in range(3):
        c: list[str] = []
        hc = install_signal_handlers(lambda t, c=c: c.append(t.kind), signals=(signal.SIGUSR1,))
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            _wait(lambda c=c: bool(c))
            assert c == ["sigusr1"]
        finally:
            hc.uninstall()
            hc.join(5.0)


def test_without_native_extension_warns_and_installs_nothing(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    import cudasnap._native

    def broken() -> Any:
        raise ImportError("cudasnap._C not built")

    monkeypatch.setattr(cudasnap._native, "native", broken)
    with caplog.at_level(logging.WARNING, logger="cudasnap.triggers"):
        h = install_signal_handlers(lambda t: None, signals=(signal.SIGUSR1,))
    assert h.installed == [] and "signal triggers disabled" in caplog.text and "not built" in caplog.text
    h.uninstall()  # harmless
