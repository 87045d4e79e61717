"""torchrun's in-place restarts on its shared rendezvous store (pytorch#135712): rank 0 warns,
naming the two ways out. The real run that needs them: tests/e2e/test_torchtitan.py."""
from __future__ import annotations

import logging

import pytest

from cudasnap.distributed.kv import restarts_share_the_store, warn_if_restarts_share_the_store

SHARED = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "2",
          "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize(("env", "risky"), [
    (SHARED, True),
    (dict(SHARED, TORCHELASTIC_MAX_RESTARTS="0"), False),  # cudasnap run -- torchrun --max-restarts=0
    (dict(SHARED, TORCHELASTIC_USE_AGENT_STORE="False"), False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (dict(SHARED, TORCHELASTIC_MAX_RESTARTS="many"), False),
    ({}, False),  # not under torchrun
])
def test_only_in_place_restarts_on_the_shared_store_are_flagged(env: dict[str, str],
                                                                risky: bool) -> None:
    assert restarts_share_the_store(env) is risky


def test_rank_0_warns_with_both_ways_out(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    for k, v in SHARED.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.WARNING, logger="cudasnap.distributed"):
        warn_if_restarts_share_the_store(1)
        assert caplog.records == []
        warn_if_restarts_share_the_store(0)
    [rec] = caplog.records
    assert "pytorch#135712" in rec.message
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in rec.message
    assert "--max-restarts=0" in rec.message
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cudasnap.distributed"):
        warn_if_restarts_share_the_store(0)
    assert caplog.records == []
