"""Tests for cudasnap.triggers.kinds: Trigger and Xid classes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.triggers import clean_trigger_env  # noqa: F401 (autouse fixture)

from cudasnap.triggers.kinds import Trigger, classify_xid

REPO = Path(__file__).resolve().parents[2]


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
