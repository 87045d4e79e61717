"""Issue 46: an in-process restart (cudasnap.distributed.inprocess) on 2 CPU ranks and one
warm spare over gloo: rank 1 SIGKILLed from outside at a random moment of a random step; the
survivor keeps its process (same pid, same model and optimizer objects), the spare takes rank
1 and restores its state from the dead rank's arena in shared memory, the survivor from its
own; at most one step is replayed and the final state of every rank equals a run that never
failed, bitwise (tools/stacks/inprocess_harness.py)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tools.stacks import inprocess_harness as harness

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(1 << 30))
STEPS = 30


def test_a_lost_rank_is_taken_by_a_spare_and_the_survivor_keeps_its_process(
        tmp_path: Path) -> None:
    rng = random.Random(SEED)
    ref = harness.reference(tmp_path / "ref", 2, STEPS)
    assert ref.rc == {0: 0, 1: 0}, ref.text()
    kill_after = rng.randrange(3, STEPS - 5)
    t = harness.run(tmp_path / "ip", 2, 1, STEPS, victim=1, kill_after=kill_after, rng=rng)
    log = f"KILL_SEED={SEED} kill_after={kill_after}\n{t.text()}"
    assert t.killed_at is not None, log
    assert t.rc[0] == 0 and t.rc[2] == 0 and t.rc[1] == -9, (t.rc, log)
    by_uid = {}
    for s in t.starts:
        by_uid.setdefault(s["uid"], []).append(s)
    # the survivor: one process through both generations, its state from its own arena
    assert [s["gen"] for s in by_uid[0]] == [0, 1], log
    assert len({s["pid"] for s in by_uid[0]}) == 1, log
    # the spare: rank 1 of generation 1, from the dead rank's arena
    (spare,) = by_uid[2]
    assert spare["gen"] == 1 and spare["rank"] == 1 and spare["src"] == "shm", log
    resumed = {s["start"] for s in t.starts if s["gen"] == 1}
    assert len(resumed) == 1, log
    (start,) = resumed
    assert t.killed_after_step is not None
    assert 0 <= t.killed_after_step + 1 - start <= 1, log  # at most one step replayed
    assert t.recovered_s() is not None, log
    a, b = ref.dumps(2), t.dumps(2)
    for rank in (0, 1):
        assert a[rank]["tensors"].keys() == b[rank]["tensors"].keys()
        differ = [k for k in a[rank]["tensors"]
                  if not torch.equal(a[rank]["tensors"][k], b[rank]["tensors"][k])]
        assert differ == [], (rank, differ, log)
    assert b[0]["pids"] == [by_uid[0][0]["pid"]] * 2 and b[1]["uid"] == 2
