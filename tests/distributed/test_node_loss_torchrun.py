"""Node loss with two real torchrun agents on this host (issue 25 item 5).

Two agents (``--nnodes 2 --rdzv-backend c10d``, a standalone rendezvous store), one rank
each, DDP on gloo; node 1's rank kills its agent and itself once its replica of step 9 is
acknowledged; its shared memory is removed and a replacement agent (new node id, empty
memory) joins. The job resumes from the copy in node 0's memory, one step replayed, and
ends bitwise equal to a run without failure (tests/dist/node_torchrun.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import node_launch  # noqa: E402
import node_torchrun  # noqa: E402


@pytest.mark.slow
def test_torchrun_node_replaced_resumes_from_peer_memory_bitwise(tmp_path):
    ref = node_launch.reference(tmp_path / "ref", steps=16)
    assert ref.ok(), ref.logs()
    r = node_torchrun.run(tmp_path / "run", steps=16, kill_step=10, timeout=300)
    assert r.ok() and r.kill is not None, r.logs()
    assert sorted(r.ranks) == [0, 1], r.logs()
    starts = {r.ranks[k]["start"] for k in (0, 1)}
    assert starts == {10}, r.logs()  # step 9 restored: 1 step replayed
    sources = {r.ranks[k]["node"]: r.ranks[k]["restore"]["source"] for k in (0, 1)}
    new = next(n for n in sources if n.endswith("-new"))
    assert sources[new].startswith("peer-memory:"), sources
    for rank in (0, 1):
        x, y = r.state(rank), ref.state(rank)
        assert sorted(x) == sorted(y) and all(np.array_equal(x[k], y[k]) for k in x), rank
