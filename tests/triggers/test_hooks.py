"""Tests for cudasnap.triggers.hooks: exception triggers."""

from __future__ import annotations

import sys
import threading

import pytest

from cudasnap.triggers.hooks import install_excepthook
from cudasnap.triggers.kinds import Trigger
from cudasnap.triggers.policy import (
    Action,
)

A = Action


@pytest.fixture(autouse=True)
def _no_env_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)


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


def test_same_exception_reported_once_through_both_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception seen by threading.excepthook and again by sys.excepthook (or twice by one)
    is one trigger. (Was exercised through the removed dead ``triggers.guard()``.)"""
    got: list[Trigger] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    hooks = install_excepthook(got.append)
    try:
        exc = KeyError("k")
        sys.excepthook(KeyError, exc, None)
        sys.excepthook(KeyError, exc, None)
        th = threading.Thread(target=lambda: (_ for _ in ()).throw(exc), name="worker")
        th.start()
        th.join()
        sys.excepthook(SystemExit, SystemExit(0), None)
    finally:
        hooks.uninstall()
    assert [t.detail for t in got] == ["KeyError: 'k'"]

