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


def _error_of_a_dead_store() -> BaseException:
    """torch's own error from a TCPStore client whose server process was killed."""
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    code = ("import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, "
            "is_master=True, wait_for_workers=False); print(s.port, flush=True); time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
    finally:
        server.kill()
        server.wait()
    try:
        client.get("k")
    except Exception as e:  # noqa: BLE001 - the error is what the test looks at
        return e
    raise AssertionError("a store whose server is dead answered")


def test_a_lost_store_is_named_with_where_it_lived(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudasnap.distributed.kv import store_lost

    err = _error_of_a_dead_store()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a new store per round
    why = store_lost(err)
    assert why is not None and "coordination store is unreachable" in why
    assert "rank 0's process" in why and "shared memory" in why
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "torchrun's agent" in (store_lost(err) or "")
    assert store_lost(ValueError("bad")) is None
    assert store_lost(RuntimeError("Connection closed")) is None  # only torch's network error
