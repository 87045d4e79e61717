"""The Snapshotter's ``node_replica`` keyword (and ``fresh``) reach the distributed
coordinator, which starts node-loss replication (cudasnap.distributed.replica): keyword wins,
None leaves the choice to CUDASNAP_NODE_REPLICA / CUDASNAP_FRESH. The replication itself
is tested end to end in tests/distributed/test_node_loss.py."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import cudasnap
import cudasnap.distributed.coordinator as coordinator


class Spy:
    """Stands in for the Coordinator: records how the Snapshotter built it."""

    seen: list[dict[str, Any]] = []

    def __init__(self, local: Any, **kw: Any) -> None:
        Spy.seen.append(kw)

    def close(self, *_: Any, **__: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@pytest.mark.parametrize("kw, expect", [({"node_replica": True}, True), ({}, None),
                                        ({"node_replica": False, "fresh": True}, False)])
def test_node_replica_keyword_reaches_the_coordinator(tmp_path, monkeypatch, kw, expect):
    monkeypatch.setattr(coordinator, "Coordinator", Spy)
    Spy.seen.clear()
    m = torch.nn.Linear(2, 2)
    snap = cudasnap.Snapshotter(m, torch.optim.SGD(m.parameters(), lr=0.1),
                                directory=tmp_path / "ckpt", rank=0, world_size=2,
                                distributed=True, health=False, **kw)
    try:
        assert len(Spy.seen) == 1
        assert Spy.seen[0]["node_replica"] is expect
        assert Spy.seen[0]["fresh"] is bool(kw.get("fresh", False))
    finally:
        snap.dist = None
        snap.close()
