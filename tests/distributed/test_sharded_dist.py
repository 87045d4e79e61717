"""FSDP2 (2 and 4 ranks), tensor parallel (2 ranks) and HSDP (4 ranks, 2x2 mesh) under
torchrun (CPU/gloo): SIGKILL one rank mid-run, torchrun
--max-restarts restarts the job, every rank resumes from its local shard, and the
final gathered state (parameters and optimizer state) is bitwise equal to an
uninterrupted run of the same script (tools/dist/sharded_train.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tools.dist import launch

SCRIPT = Path(launch.__file__).with_name("sharded_train.py")
STEPS = 10


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _ok(r: launch.Run) -> str:
    return f"rc={r.rc} after {r.seconds:.0f} s\n{launch.log_tail(r)}"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "world", "victim"),
                         [("fsdp", 2, 1), ("fsdp", 4, 2), ("tp", 2, 0), ("hsdp", 4, 3)],
                         ids=["fsdp2-2ranks", "fsdp2-4ranks", "tp-2ranks", "hsdp-2x2"])
def test_sharded_sigkill_restart_resumes_bitwise(tmp_path: Path, mode: str, world: int,
                                                 victim: int) -> None:
    env = {"MODE": mode, "STEPS": str(STEPS)}
    ref = launch.run(tmp_path / "ref", nproc=world, max_restarts=0, script=SCRIPT,
                     env={**env, "NO_SNAP": "1", "DUMP_STEPS": "1"})
    assert ref.rc == 0 and len(ref.ranks) == world, _ok(ref)
    r = launch.run(tmp_path / "kill", nproc=world, script=SCRIPT,
                   env={**env, "KILL_RANK": str(victim), "KILL_STEP": "6",
                        "CUDASNAP_PEER_TIMEOUT_S": "10"})
    launch.cleanup_arenas(r.job)
    assert r.rc == 0 and len(r.ranks) == world, _ok(r)
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


@pytest.mark.slow
def test_hsdp_lost_rank_restores_from_its_replicate_group_and_exports(tmp_path: Path) -> None:
    """HSDP on a 2x2 (replicate, shard) mesh of 4 ranks: a committed step; then rank 3's
    files and every arena are lost (its node replaced): rank 3 loads its shard from rank 1
    (same shard, other replica). The same snapshot exported to DCP loads, resharded, into
    one unsharded process and into FSDP2 on 2 ranks, where training goes on; exported to
    safetensors, it is the full state."""
    import shutil

    import torch
    from safetensors.torch import load_file

    import cudasnap
    from cudasnap.tools.export import export_dcp, export_safetensors

    env = {"MODE": "hsdp", "STEPS": "6", "FLUSH_AT_END": "1"}
    r1 = launch.run(tmp_path, nproc=4, max_restarts=0, script=SCRIPT, env=env)
    launch.cleanup_arenas(r1.job)
    assert r1.rc == 0 and len(r1.ranks) == 4, _ok(r1)
    step_dir = r1.ckpt / "step-00000005"
    assert (step_dir / "COMMIT").is_file()
    shutil.rmtree(step_dir / "rank-00003")
    r2 = launch.run(tmp_path, nproc=4, max_restarts=0, script=SCRIPT, job=r1.job, out="out2",
                    env={"MODE": "hsdp", "STEPS": "7"})
    launch.cleanup_arenas(r2.job)
    assert r2.rc == 0 and len(r2.ranks) == 4, _ok(r2)
    sources = {rank: info["restore"]["source"] for rank, info in r2.ranks.items()}
    assert sources == {0: "disk", 1: "disk", 2: "disk", 3: "replica:1"}, sources
    for rank in range(4):
        assert _equal(r2.restored(rank), r1.state(rank)), f"rank {rank}: restored state differs"

    # Export (rank 3's files are gone: the replicated shards of rank 1 stand in).
    full = r1.state(0)
    st = export_safetensors(r1.ckpt, tmp_path / "full.safetensors")
    got = load_file(str(st))
    for k in ("0.weight", "2.weight", "4.bias"):
        assert np.array_equal(got[k].numpy(), full[f"m.{k}"]), k
    out = export_dcp(r1.ckpt, tmp_path / "dcp")
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 13), torch.nn.Tanh(),
                                torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    assert cudasnap.load_resharded(out, model, opt) == 6
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), full[f"m.{k}"]), k
    for n, p in model.named_parameters():
        assert np.array_equal(opt.state[p]["exp_avg"].numpy(), full[f"o.{n}.exp_avg"]), n
    r3 = launch.run(tmp_path, nproc=2, max_restarts=0, script=SCRIPT, out="out3", ckpt="none",
                    env={"MODE": "fsdp", "STEPS": "8", "NO_SNAP": "1", "LOAD_DCP": str(out)})
    assert r3.rc == 0 and len(r3.ranks) == 2, _ok(r3)
    for rank in range(2):  # 4 ranks (2x2 HSDP) -> 2 ranks (FSDP2): the same full state
        assert _equal(r3.restored(rank), full), f"rank {rank}: resharded state differs"
        assert not _equal(r3.state(rank), full)  # and two more steps trained from it
    # The same export loaded as torchtitan loads (get_state_dict -> dcp.load -> set_state_dict
    # by parameter FQN, on 3 ranks: uneven shards): the same state, the same two steps.
    r4 = launch.run(tmp_path, nproc=3, max_restarts=0, script=SCRIPT, out="out4", ckpt="none",
                    env={"MODE": "fsdp", "STEPS": "8", "NO_SNAP": "1", "LOAD_DCP": str(out),
                         "LOAD_API": "dsd"})
    assert r4.rc == 0 and len(r4.ranks) == 3, _ok(r4)
    for rank in range(3):
        assert _equal(r4.restored(rank), full), f"rank {rank}: DSD-loaded state differs"
