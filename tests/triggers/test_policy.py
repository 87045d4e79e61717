"""Tests for cudasnap.triggers.policy: defaults, exit codes, CUDASNAP_POLICY."""

from __future__ import annotations

import pytest

from cudasnap.config import Settings
from cudasnap.triggers.kinds import Trigger
from cudasnap.triggers.policy import (
    EXIT_GPU_FAULT,
    EXIT_GPU_LOST,
    EXIT_HANG,
    EXIT_PEER_FAILURE,
    EXIT_PREEMPTED,
    Action,
    Policy,
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
    p = Policy.from_settings(Settings.from_env())
    assert p.decide(Trigger("thermal")) == (A.FLUSH, None)
    assert p.decide(Trigger("sigusr1")) == (A.FLUSH_AND_EXIT, 78)
    assert p.decide(Trigger("xid", code=62)) == (A.FLUSH, None)
    assert p.decide(Trigger("xid", code=79)) == (A.FLUSH_AND_EXIT, 76)   # untouched
    assert p.decide(Trigger("hang")) == (A.FLUSH_AND_EXIT, 90)
    q = Policy.from_settings(Settings.from_env({"CUDASNAP_POLICY": "xid=ignore,gpu_lost=log"}))
    assert q.decide(Trigger("xid", code=79)) == (A.IGNORE, None)
    assert q.decide(Trigger("gpu_lost")) == (A.LOG, None)
    assert Policy.from_settings(Settings.from_env({})).rules == Policy().rules


@pytest.mark.parametrize("spec,entry", [
    ("thermal=explode", "thermal=explode"), ("bogus=flush", "bogus=flush"), ("thermal", "thermal"),
    ("ecc_dbe=flush, hang=flush:3", "hang=flush:3"), ("hang=flush_exit:x", "hang=flush_exit:x"),
    ("xid.weird=log", "xid.weird=log"),
])
def test_policy_env_errors(spec: str, entry: str) -> None:
    with pytest.raises(ValueError) as ei:
        Policy.from_settings(Settings.from_env({"CUDASNAP_POLICY": spec}))
    assert repr(entry) in str(ei.value) and "CUDASNAP_POLICY" in str(ei.value)
