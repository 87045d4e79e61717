"""``cudasnap run --inprocess`` (cudasnap.supervisor.inprocess_launch): the launcher hosts the
control store and starts the ranks and the spares; a rank SIGKILLed from outside at a random
moment is taken by a spare while the other keeps its process; with no spare the launcher falls
back to a full restart, saying why. Both end bitwise equal to a run that never failed."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from cudasnap.errors import ConfigError
from cudasnap.supervisor.inprocess_launch import Layout
from tools.stacks import inprocess_harness as harness

SEED = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(1 << 30))
STEPS = 24


def test_layout_names_the_processes_and_refuses_what_cannot_be() -> None:
    assert Layout.parse(4, 1, None) == Layout(world=4, nproc=5, first=0, last=4)
    assert Layout.parse(4, 2, "4-5") == Layout(world=4, nproc=6, first=4, last=5)
    for args, msg in [((0, 1, None), "--nproc"), ((2, -1, None), "--spares"),
                      ((2, 1, "1-3"), "outside"), ((2, 1, "x"), "A-B")]:
        with pytest.raises(ConfigError, match=msg):
            Layout.parse(*args)  # type: ignore[arg-type]


def _equal(ref: harness.Trial, t: harness.Trial, world: int) -> list[tuple[int, str]]:
    a, b = ref.dumps(world), t.dumps(world)
    return [(r, k) for r in range(world) for k in a[r]["tensors"]
            if not torch.equal(a[r]["tensors"][k], b[r]["tensors"][k])]


@pytest.mark.slow
@pytest.mark.parametrize("spares", [1, 0])
def test_run_inprocess_recovers_in_place_or_falls_back_to_a_full_restart(
        tmp_path: Path, spares: int) -> None:
    rng = random.Random(f"{SEED}-{spares}")
    ref = harness.reference(tmp_path / "ref", 2, STEPS)
    kill_after = rng.randrange(3, STEPS - 6)
    t = harness.classic(tmp_path / "run", 2, STEPS, victim=1, kill_after=kill_after, rng=rng,
                        spares=spares)
    log = f"KILL_SEED={SEED} kill_after={kill_after}\n{t.text(200)}"
    assert t.killed_at is not None and t.rc[0] == 0, log
    after = [s for s in t.starts if s["t"] > t.killed_at]
    assert sorted(s["rank"] for s in after) == [0, 1], log
    survivor = [s for s in t.starts if s["uid"] == 0]
    if spares:  # in place: the survivor's process kept, the spare (uid 2) took rank 1
        assert len({s["pid"] for s in survivor}) == 1, log
        assert {s["uid"] for s in after if s["rank"] == 1} == {2}, log
        assert "full restart" not in log, log
    else:  # every process started again, and the launcher said why
        assert len({s["pid"] for s in survivor}) == 2, log
        assert "0 spare(s) left: the job needs a full restart: full restart 1 of 3" in log, log
    assert all(s["src"] == "shm" for s in after), log
    replayed = t.replayed()
    assert replayed is not None and 0 <= replayed <= 1, (replayed, log)
    assert _equal(ref, t, 2) == [], log
