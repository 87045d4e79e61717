"""Multi-rank snapshots on CPU/gloo: torchrun kill/hang/restart runs and in-process spawn tests.

The torchrun tests run tools/dist/ddp_train.py (DDP, 4 ranks) and compare
with an uninterrupted reference run of the same script. With a fixed DDP
bucket layout (see the script) the resumed runs are bitwise identical to the
reference on every rank.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cudasnap.storage.listing import committed_steps, read_commit
from tools.dist import launch

STEPS = 20
WORLD = 4


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _ok(r: launch.Run) -> str:
    return f"rc={r.rc} after {r.seconds:.0f} s\n{launch.log_tail(r)}"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def ref(base: Path) -> launch.Run:
    """Uninterrupted run, no snapshots, state saved after every step."""
    r = launch.run(base / "ref", max_restarts=0,
                   env={"STEPS": str(STEPS), "NO_SNAP": "1", "DUMP_STEPS": "1"})
    assert r.rc == 0 and len(r.ranks) == WORLD, _ok(r)
    return r


def _check_resumed(r: launch.Run, ref: launch.Run, restored_step: int) -> None:
    for rank in range(WORLD):
        info = r.ranks[rank]
        assert info["start"] == restored_step + 1, (rank, info)
        assert _equal(r.restored(rank), ref.step_state(rank, restored_step)), \
            f"rank {rank}: restored state differs from the reference at step {restored_step}"
        assert _equal(r.state(rank), ref.state(rank)), \
            f"rank {rank}: final state differs from the reference"


def _events(r: launch.Run, event: str, epoch: int = 0) -> list[dict]:
    return [e for e in r.events() if e["event"] == event and e["epoch"] == epoch]


@pytest.fixture(scope="module")
def killed(base: Path) -> launch.Run:
    r = launch.run(base / "kill", env={"STEPS": str(STEPS), "KILL_RANK": "2", "KILL_STEP": "14",
                                       "CUDASNAP_PEER_TIMEOUT_S": "5"})
    launch.cleanup_arenas(r.job)
    return r


@pytest.mark.slow
def test_sigkill_one_rank_flush_restart_resume(killed: launch.Run, ref: launch.Run) -> None:
    r = killed
    assert r.rc == 0 and len(r.ranks) == WORLD, _ok(r)
    assert "Unable to shutdown" not in r.log, "a survivor outlived torchrun's SIGTERM grace"
    # --max-restarts=1 on torchrun's shared store (the script's FileStore per attempt sidesteps it)
    assert "pytorch#135712" in r.log, launch.log_tail(r)
    kill = r.kill()
    assert kill is not None and kill["step"] == 14
    committed = _events(r, "committed")
    # Step 13 unless rank 2's copy of it was still running when it died (then 12).
    assert len(committed) == 1 and committed[0]["step"] in (12, 13), committed
    assert committed[0]["present"] == [0, 1, 2, 3]
    assert read_commit(r.ckpt / f"step-{committed[0]['step']:08d}")["dead"] == [2]
    # The survivors' flushes start, agree and commit within seconds of the kill.
    assert committed[0]["t"] - kill["t"] < 10, (committed[0]["t"] - kill["t"])
    for rank, info in r.ranks.items():
        assert info["attempt"] == 1
        restored = info["restore"]["step"]
        assert kill["step"] - 1 - restored <= 1, info  # replayed steps
        if rank == 2:
            assert info["restore"]["source"] == "shm"  # the killed rank: its own arena
    _check_resumed(r, ref, r.ranks[0]["restore"]["step"])


@pytest.mark.slow
def test_sigstop_hang_detected_flushed_resumed(base: Path, ref: launch.Run) -> None:
    timeout_s = 3.0
    r = launch.run(base / "stop", env={"STEPS": str(STEPS), "KILL_RANK": "1", "KILL_STEP": "10",
                                       "KILL_SIG": "SIGSTOP",
                                       "CUDASNAP_PEER_TIMEOUT_S": str(timeout_s)})
    launch.cleanup_arenas(r.job)
    assert r.rc == 0 and len(r.ranks) == WORLD, _ok(r)
    stop = r.kill()
    starts = _events(r, "flush_start")
    assert starts, _ok(r)
    detect = min(e["t"] for e in starts) - stop["t"]
    # (its last heartbeat may be up to one interval older than the stop)
    assert timeout_s - 1 <= detect < timeout_s + 3, detect
    committed = _events(r, "committed")
    assert len(committed) == 1 and committed[0]["step"] in (8, 9), committed
    step = committed[0]["step"]
    assert read_commit(r.ckpt / f"step-{step:08d}")["dead"] == [1]
    assert all(info["attempt"] == 1 for info in r.ranks.values())
    restored = r.ranks[0]["restore"]["step"]
    assert stop["step"] - 1 - restored <= 1  # replayed steps
    _check_resumed(r, ref, restored)


@pytest.fixture(scope="module")
def died(base: Path) -> tuple[launch.Run, launch.Run]:
    """Phase 1: step 8 committed; rank 2 SIGKILLed at step 14; rank 1 dies inside the
    flush of step 13 (or 12): that round fails, the next one counts rank 1 as dead too and
    commits the step from both dead ranks' arenas. Then every arena and rank 2's files of
    that step are removed (say rank 2's node was replaced). Phase 2: the same job again."""
    env = {"STEPS": str(STEPS), "FLUSH_AT": "8", "KILL_RANK": "2", "KILL_STEP": "14",
           "CUDASNAP_TEST_DIE_IN_FLUSH": "1:10", "CUDASNAP_PEER_TIMEOUT_S": "5"}
    r1 = launch.run(base / "die", max_restarts=0, env=env)
    launch.cleanup_arenas(r1.job)
    newest = committed_steps(r1.ckpt)[0].path if committed_steps(r1.ckpt) else None
    if newest is not None and (newest / "rank-00002").is_dir():
        shutil.rmtree(newest / "rank-00002")
    r2 = launch.run(base / "die", max_restarts=0, job=r1.job, out="out2",
                    env={"STEPS": str(STEPS)})
    launch.cleanup_arenas(r2.job)
    return r1, r2


@pytest.mark.slow
def test_rank_dies_during_flush_the_next_round_commits_its_arena(died, ref: launch.Run) -> None:
    r1, r2 = died
    assert r1.rc != 0 and not r1.ranks, _ok(r1)
    failed = _events(r1, "commit_failed")
    assert len(failed) == 1 and failed[0]["step"] in (12, 13) and failed[0]["ranks"] == [1], \
        _ok(r1)
    step = failed[0]["step"]
    # The next round: rank 1 in D with rank 2, both arenas flushed by rank 0, on this host.
    assert max(c["step"] for c in _events(r1, "committed")) == step, _ok(r1)
    commit = read_commit(r1.ckpt / f"step-{step:08d}")
    assert commit["dead"] == [1, 2] and commit["present"] == [0, 1, 2, 3], commit
    assert "flushed dead rank 1's arena" in r1.log, _ok(r1)
    assert committed_steps(r1.ckpt)[0].step == step
    assert r2.rc == 0 and len(r2.ranks) == WORLD, _ok(r2)
    assert {i["restore"]["step"] for i in r2.ranks.values()} == {step}
    _check_resumed(r2, ref, step)


@pytest.mark.slow
def test_lost_rank_restores_from_replica_files(died, ref: launch.Run) -> None:
    """The killed rank 2 lost its arena and its files of the committed step: it loads rank 0's."""
    r1, r2 = died
    step = committed_steps(r1.ckpt)[0].step
    assert not (r1.ckpt / f"step-{step:08d}" / "rank-00002").exists()
    assert r2.rc == 0 and len(r2.ranks) == WORLD, _ok(r2)
    sources = {rank: info["restore"]["source"] for rank, info in r2.ranks.items()}
    assert sources == {0: "disk", 1: "disk", 2: "replica:0", 3: "disk"}, sources
    # DDP replicas hold the same tensors; the data position in the host state is the
    # same on every rank, so rank 2 resumes its own data stream bitwise.
    _check_resumed(r2, ref, step)


# ------------------------------------------------------------- spawn tests
def _spawn(base: Path, world: int, scenarios: list[str]) -> dict[str, list[dict]]:
    import torch.multiprocessing as mp

    from tools.dist import spawn_worker

    mp.spawn(spawn_worker.worker, args=(world, str(base), scenarios), nprocs=world, join=True)
    out = {}
    for sc in scenarios:
        out[sc] = [json.loads((base / f"{sc}-rank-{r}.json").read_text()) for r in range(world)]
        for r, res in enumerate(out[sc]):
            assert "crash" not in res, f"{sc} rank {r}:\n{res['crash']}"
    return out


def _restore_here(base: Path, name: str, directory: Path, replicas) -> dict:
    """A 1-rank job in this process restores a 2-rank snapshot (world size changed)."""
    import torch.distributed as dist

    from tools.dist import spawn_worker

    try:
        return spawn_worker._restore(base, 0, 1, name, directory, replicas)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_multi_rank_flush_honours_its_timeout_with_latest_locked(tmp_path: Path) -> None:
    """Issue 47: another writer holds ``latest``'s lock for 60 s; ``flush(timeout=3)`` on
    every rank returns within its bound and the step is committed (``latest`` left as it
    was: a restore finds the step by listing). Before, the committer waited for the lock
    without a bound."""
    res = _spawn(tmp_path, 2, ["latest_locked"])["latest_locked"]
    for rank, r in enumerate(res):
        assert r["seconds"] < 8.0, res
        assert r["committed"], res  # and each rank knows it
        assert r["path"].endswith(f"step-00000003/rank-0000{rank}"), res


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    base = tmp_path_factory.mktemp("spawn")
    res = _spawn(base, 2, ["save_sharded", "save_replicated", "missing_shard"])
    res["world1_sharded"] = [_restore_here(base, "w1s", base / "sharded_copy", None)]
    res["world1_replicated"] = [_restore_here(base, "w1r", base / "save_replicated", "all")]
    # Rank 1 ends one step past the committed step, so its close() keeps its arena (issue
    # 44: never the only copy); this test's job is done with it.
    for a in Path("/dev/shm").glob(f"cudasnap-{base.name}-*"):
        a.unlink(missing_ok=True)
    return base, res


@pytest.mark.slow
def test_a_step_no_rank_can_assemble_is_never_a_silent_step_0(tmp_path: Path) -> None:
    """Rank 1's memory lost, nothing on disk (issue 35): every rank starts over only with
    an ERROR naming the step and the rank that lacks it; require_resume refuses instead."""
    res = _spawn(tmp_path, 2, ["lost_memory"])["lost_memory"]
    for rank, r in enumerate(res):
        assert r["start"] == 0, r
        said = [e for e in r["errors"] if "starting over at step 0" in e]
        assert said and "step 3 is in the memory of rank(s) [0] but rank(s) [1]" in said[0], r
        assert "strict" not in r and "require_resume" in r["strict_error"], r
        assert "step 3 is in the memory" in r["strict_error"], r
    for p in Path("/dev/shm").glob(f"cudasnap-{tmp_path.name}-*"):
        p.unlink(missing_ok=True)


@pytest.mark.slow
def test_slots_newer_than_the_restored_step_are_emptied(tmp_path: Path) -> None:
    """Rank 1's memory lost, step 1 on disk: both restore step 1; rank 0's arena no longer
    holds its steps 2 and 3 of the run before (a flush of the re-run's step 2 would take
    the first slot of that step it finds)."""
    res = _spawn(tmp_path, 2, ["restored_older"])["restored_older"]
    for r in res:
        assert r["start"] == 2, res
        assert all(s <= 1 for s in r["arena_steps"]), res
    for p in Path("/dev/shm").glob(f"cudasnap-{tmp_path.name}-*"):
        p.unlink(missing_ok=True)


@pytest.mark.slow
def test_spawn_agreed_step_commit_and_join(spawned) -> None:
    base, res = spawned
    r0, r1 = res["save_sharded"]
    # Newest first; the arenas hold 3 slots (2 + the spare one used during flushes).
    assert r0["complete"][:2] == [5, 4] and r1["complete"][:2] == [6, 5]
    # Newest step COMPLETE on both ranks; rank 1 joined the round rank 0 asked for.
    assert r0["path"] == str(base / "save_sharded" / "step-00000005" / "rank-00000")
    assert r1["last_flush"]["step"] == "5" and r1["last_flush"]["committed"] == "True"
    commit = read_commit(base / "save_sharded" / "step-00000005")
    assert commit["present"] == [0, 1] and commit["world_size"] == 2 and commit["dead"] == []
    assert (base / "save_sharded" / "latest").read_text().strip() == "step-00000005"
    # A second trigger with nothing newer returns the committed result without a round.
    assert r0["again"] == r0["path"] and r0["again_s"] < 0.5 and r0["gen"] == 1


def test_spawn_sharded_missing_shard_is_an_error_on_every_rank(spawned) -> None:
    _, res = spawned
    for r in res["missing_shard"]:
        assert "error" in r, r
        assert r["error"].startswith("IncompatibleSnapshot") and "rank 1" in r["error"] \
            and "step 5" in r["error"], r["error"]


def test_spawn_world_size_change(spawned) -> None:
    _, res = spawned
    [r] = res["world1_sharded"]
    assert "error" in r and "saved by 2 ranks" in r["error"] and "has 1" in r["error"], r
    [r] = res["world1_replicated"]
    assert r.get("start") == 6 and r["restore"]["source"] == "disk", r
    assert r["weights"] == res["save_replicated"][0]["weights"]  # rank 0's files


_FIRST_BEAT = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
import cudasnap
store = dist.FileStore(sys.argv[1] + "/store", 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
snap = cudasnap.Snapshotter(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            directory=sys.argv[1] + "/ckpt", distributed=True, health=False)
c = snap.dist
print("BEAT" if c.kv.get("hb/0") is not None else "NOBEAT", flush=True)
snap.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_first_heartbeat_is_published_before_the_coordinator_returns(tmp_path: Path) -> None:
    """A rank frozen right after start (before its monitor thread first ran) was never
    timed out: "a peer that never sent a heartbeat" is one still starting. Its first
    heartbeat is now part of the Coordinator's construction."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"OMP_NUM_THREADS": "1", "CUDASNAP_JOB": f"fb{os.getpid()}"})
    p = subprocess.run([sys.executable, "-c", _FIRST_BEAT, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=240)
    for a in Path("/dev/shm").glob(f"cudasnap-fb{os.getpid()}-*"):
        a.unlink(missing_ok=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BEAT" in p.stdout.split() and "NOBEAT" not in p.stdout, p.stdout + p.stderr[-2000:]
