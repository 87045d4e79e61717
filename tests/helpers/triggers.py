"""Shared pieces of the trigger tests (test_inject, test_nvml, test_kinds)."""
from __future__ import annotations

import threading
import time

import pytest

from cudasnap.triggers.kinds import Trigger
from helpers import parts


class Collector:
    """Thread-safe trigger sink with a wait helper."""

    def __init__(self) -> None:
        self.items: list[Trigger] = []
        self.cond = threading.Condition()

    def __call__(self, trig: Trigger) -> None:
        with self.cond:
            self.items.append(trig)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 3.0) -> list[Trigger]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.items) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {n} triggers, got {self.items}")
                self.cond.wait(left)
            return list(self.items)

    def kinds(self) -> list[str]:
        with self.cond:
            return [t.kind for t in self.items]


@pytest.fixture(autouse=True)
def clean_trigger_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_INJECT", raising=False)
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parts.reset_nvml_warning(monkeypatch)
