"""Tests for cudasnap.triggers.kinds: Trigger and Xid classes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cudasnap.triggers import nvml as _nvml
from cudasnap.triggers.kinds import Trigger, classify_xid

REPO = Path(__file__).resolve().parents[1]


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
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_INJECT", raising=False)
    monkeypatch.delenv("CUDASNAP_POLICY", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(_nvml, "_warned_unavailable", False)

@pytest.mark.parametrize("code,cls", [
    (48, "fatal"), (63, "fatal"), (64, "fatal"), (74, "fatal"), (79, "fatal"), (92, "fatal"), (94, "fatal"),
    (95, "fatal"), (119, "fatal"), (120, "fatal"), (140, "fatal"),
    (13, "application"), (31, "application"), (43, "application"), (45, "application"), (68, "application"),
    (8, "other"), (61, "other"), (62, "other"), (0, "other"), (999, "other"),
])
def test_classify_xid(code: int, cls: str) -> None:
    assert classify_xid(code) == cls
    assert Trigger(kind="xid", code=code).xid_class == cls


def test_trigger_validates_kind_and_is_frozen() -> None:
    with pytest.raises(ValueError, match="unknown trigger kind 'bogus'"):
        Trigger(kind="bogus")
    t = Trigger(kind="ecc_dbe", device=1)
    assert t.xid_class is None and abs(t.time - time.time()) < 5
    with pytest.raises(Exception):
        t.kind = "xid"  # type: ignore[misc]
