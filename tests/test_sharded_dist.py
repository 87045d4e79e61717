"""FSDP2 under torchrun (2 ranks, CPU/gloo): SIGKILL one rank mid-run, torchrun
--max-restarts restarts the job, every rank resumes from its local shard, and the
final gathered state (parameters and optimizer state) is bitwise equal to an
uninterrupted run of the same script (tests/dist/sharded_train.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.dist import launch

SCRIPT = Path(launch.__file__).with_name("sharded_train.py")
STEPS = 10
WORLD = 2


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _ok(r: launch.Run) -> str:
    return f"rc={r.rc} after {r.seconds:.0f} s\n{launch.log_tail(r)}"


@pytest.mark.slow
def test_fsdp2_sigkill_restart_resumes_bitwise(tmp_path: Path) -> None:
    env = {"MODE": "fsdp", "STEPS": str(STEPS)}
    ref = launch.run(tmp_path / "ref", nproc=WORLD, max_restarts=0, script=SCRIPT,
                     env={**env, "NO_SNAP": "1", "DUMP_STEPS": "1"})
    assert ref.rc == 0 and len(ref.ranks) == WORLD, _ok(ref)
    r = launch.run(tmp_path / "kill", nproc=WORLD, script=SCRIPT,
                   env={**env, "KILL_RANK": "1", "KILL_STEP": "6",
                        "CUDASNAP_PEER_TIMEOUT_S": "5"})
    launch.cleanup_arenas(r.job)
    assert r.rc == 0 and len(r.ranks) == WORLD, _ok(r)
    assert r.kill() is not None and r.kill()["step"] == 6
    restored = {info["restore"]["step"] for info in r.ranks.values()}
    assert len(restored) == 1 and restored.pop() in (4, 5), r.ranks  # <= 1 step replayed
    for rank, info in r.ranks.items():
        assert info["attempt"] == 1, info
        step = info["restore"]["step"]
        assert _equal(r.restored(rank), ref.step_state(rank, step)), \
            f"rank {rank}: restored state differs from the reference at step {step}"
        assert _equal(r.state(rank), ref.state(rank)), \
            f"rank {rank}: final state differs from the uninterrupted run"
