"""Issue 45 item 1 under FSDP2: torchao's AdamW8bit state is a DTensor whose local shard is
an OptimState8bit; the snapshot holds the local shard's inner tensors with the DTensor's shard
record, and a new optimizer (no state until its first step) is rebuilt from them, bitwise
(tools/dist/subclass_fsdp2_worker.py on 2 ranks, gloo, CPU); ``export --to dcp`` writes each
rank's shard of it as DCP would."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.dist import launch

pytest.importorskip("torchao.optim", reason="torchao is not installed (requirements-extras.txt)")
SCRIPT = Path(launch.__file__).with_name("subclass_fsdp2_worker.py")

pytestmark = pytest.mark.slow


def test_low_bit_state_of_fsdp2_resumes_and_rolls_back_bitwise(tmp_path: Path) -> None:
    r = launch.run(tmp_path, nproc=2, max_restarts=0, script=SCRIPT, timeout=300,
                   env={"CUDASNAP_HEALTH": "0"})
    try:
        log = f"rc={r.rc}\n{launch.log_tail(r, 60)}"
        assert r.rc == 0, log
        assert sorted(r.ranks) == [0, 1], log
        for rank, info in r.ranks.items():
            assert info["start"] == 3, (rank, info)
            assert info["kind"] == "DTensor(OptimState8bit)", (rank, info)
            assert info["resumed_differ"] == [], (rank, info)
            assert info["rollback"] == 6 and info["rolled_differ"] == [], (rank, info)
            assert info["names"] > 10
            # the second Snapshotter of the job flushed its own step (its round 0 read the
            # first one's agreed step 2 from the store and committed that again)
            assert "step-00000005" in info["flushed"], (rank, info)
        # export --to dcp writes each rank's OptimState8bit shard as DCP does (the object);
        # dcp.load into a plain tensor of the global shape reads every rank's values
        import subprocess
        import sys

        import torch
        import torch.distributed.checkpoint as dcp

        exp = subprocess.run([sys.executable, "-m", "cudasnap", "export", str(r.ckpt), "--to",
                              "dcp", str(tmp_path / "dcp")], capture_output=True, text=True,
                             timeout=300)
        assert exp.returncode == 0, exp.stderr[-3000:]
        ranks = [torch.load(r.out / f"rank-{k}.pt") for k in (0, 1)]
        got = {"optim.state.0.weight.exp_avg": torch.zeros(128, 128)}
        dcp.load(got, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        full = got["optim.state.0.weight.exp_avg"]
        assert torch.equal(full, torch.cat([x["exp_avg"] for x in ranks]))
        assert full.abs().sum() > 0
    finally:
        launch.cleanup_arenas(r.job)
