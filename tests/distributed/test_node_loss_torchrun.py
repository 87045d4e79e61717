"""Node loss with two real torchrun agents on this host (issue 25 item 5).

Two agents (``--nnodes 2 --rdzv-backend c10d``, a standalone rendezvous store), one rank
each, DDP on gloo; node 1's rank kills its agent and itself once its replica of step 9 is
acknowledged; its shared memory is removed and a replacement agent (new node id, empty
memory) joins. The job resumes from the copy in node 0's memory, one step replayed, and
ends bitwise equal to a run without failure (tools/dist/node_torchrun.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dist"))
import node_launch  # noqa: E402
import node_torchrun  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("guard", ["off", "on"])
def test_torchrun_node_replaced_resumes_from_peer_memory_bitwise(tmp_path, guard):
    # guard "on" (CUDASNAP_HEALTH=1, as the README's torchrun mode runs): the survivor's
    # flush round, before its agent restarts it, writes the lost rank's step from the
    # guest copy its node holds and commits it; its wait for the dead rank ends when the
    # dead rank's presence port refuses, not after the 10 s silence.
    ref = node_launch.reference(tmp_path / "ref", steps=16)
    assert ref.ok(), ref.logs()
    env = {"CUDASNAP_HEALTH": "1"} if guard == "on" else {}
    r = node_torchrun.run(tmp_path / "run", steps=16, kill_step=10, timeout=300, env=env)
    assert r.ok() and r.kill is not None, r.logs()
    assert sorted(r.ranks) == [0, 1], r.logs()
    starts = {r.ranks[k]["start"] for k in (0, 1)}
    assert starts == {10}, r.logs()  # step 9 restored: 1 step replayed
    sources = {r.ranks[k]["node"]: r.ranks[k]["restore"]["source"] for k in (0, 1)}
    new = next(n for n in sources if n.endswith("-new"))
    assert sources[new].startswith("peer-memory:") or guard == "on" and sources[new] == "disk", \
        sources
    for rank in (0, 1):
        x, y = r.state(rank), ref.state(rank)
        assert sorted(x) == sorted(y) and all(np.array_equal(x[k], y[k]) for k in x), rank
    if guard == "on":
        from cudasnap.distributed.events import read_events

        committed = [e for e in read_events(r.ckpt) if e["event"] == "committed"
                     and e["step"] == 9]
        assert committed and committed[0]["present"] == [0, 1], r.logs()
        assert committed[0]["t"] - r.kill["t"] < 8, (committed[0]["t"] - r.kill["t"], r.logs())
