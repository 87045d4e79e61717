"""Sharded (DTensor) state on a 2-rank CPU mesh, in-process (spawn + gloo): FSDP2 and
tensor-parallel snapshots restore bit for bit by rollback(), from shared memory and
from disk, also for a model whose state_dict hook splits a fused parameter into copies
(``fused``: the real parameter is snapshotted, issue 32); a snapshot restored into
another mesh is refused naming both meshes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cudasnap.format.paths import MANIFEST

WORLD = 2


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict]]]:
    import torch.multiprocessing as mp

    from tools.dist import sharded_worker

    base = tmp_path_factory.mktemp("sharded")
    scenarios = ["fsdp", "tp", "mismatch", "fused"]
    mp.spawn(sharded_worker.worker, args=(WORLD, str(base), scenarios), nprocs=WORLD, join=True)
    out = {}
    for sc in scenarios:
        out[sc] = [json.loads((base / f"{sc}-rank-{r}.json").read_text()) for r in range(WORLD)]
        for r, res in enumerate(out[sc]):
            assert "crash" not in res, f"{sc} rank {r}:\n{res['crash']}"
    for p in Path("/dev/shm").glob(f"cudasnap-{base.name}-*"):
        p.unlink(missing_ok=True)
    return base, out


def _npz(base: Path, kind: str, what: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(base / f"{kind}_save-{what}-rank-{rank}.npz") as z:
        return {k: z[k] for k in z.files}


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "tp", "fused"])
def test_sharded_state_restores_bitwise(spawned, kind: str) -> None:
    base, res = spawned
    for rank, r in enumerate(res[kind]):
        assert r["rollback"] == 8, r
        assert _equal(_npz(base, kind, "rollback", rank), _npz(base, kind, "step7", rank))
        assert r["start_shm"] == 8 and r["source_shm"] == "shm", r
        assert _equal(_npz(base, kind, "restored_shm", rank), _npz(base, kind, "step7", rank))
        # disk holds step 3 (the flush) ... and the close() of the shm-restored run
        # flushed nothing (distributed): step 3 it is.
        assert r["start_disk"] == 4 and r["source_disk"] == "disk", r
        assert _equal(_npz(base, kind, "restored_disk", rank), _npz(base, kind, "step3", rank))
        # Not trivially equal: training moved the state on.
        assert not _equal(_npz(base, kind, "step3", rank), _npz(base, kind, "step7", rank))


def test_manifest_records_mesh_placements_and_uneven_offsets(spawned) -> None:
    base, _ = spawned
    ents = {}
    for rank in range(WORLD):
        m = json.loads((base / "fsdp_save" / "step-00000003" / f"rank-{rank:05d}" / MANIFEST)
                       .read_text())
        ents[rank] = {e["name"]: e for e in m["tensors"]}
    # Linear(16, 13) weight, dim 0 sharded over 2 ranks: 7 + 6 rows (uneven).
    w0, w1 = ents[0]["model.0.weight"], ents[1]["model.0.weight"]
    assert w0["shape"] == [7, 16] and w1["shape"] == [6, 16]
    for rank, e in ((0, w0), (1, w1)):
        assert e["shard"] == {"global_shape": [13, 16], "mesh_shape": [2], "mesh_dims": ["dp"],
                              "placements": ["Shard(0)"], "coord": [rank],
                              "offset": [0 if rank == 0 else 7, 0]}
    assert ents[1]["optim.state.0.exp_avg"]["shard"]["offset"] == [7, 0]
    assert "shard" not in ents[0]["model.seen"] and "shard" not in ents[0]["optim.state.0.step"]


def test_restore_into_another_mesh_names_both(spawned) -> None:
    _, res = spawned
    for r in res["mismatch"]:
        err = r.get("error", "")
        assert "mesh (2,) dims ('dp',) placements [Shard(0)]" in err, r
        assert "mesh (2,) dims ('tp',)" in err and "cudasnap export" in err, r


def _model_and_opt():
    import torch

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 13), torch.nn.Tanh(), torch.nn.Linear(13, 4))
    model.register_buffer("seen", torch.zeros(3))
    return model, torch.optim.AdamW(model.parameters(), lr=5.0)


def test_export_safetensors_consolidates_the_shards(spawned, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from cudasnap.tools.cli import main

    base, _ = spawned
    out = tmp_path / "full.safetensors"
    assert main(["export", str(base / "fsdp_save"), "--to", "safetensors", "--optimizer",
                 str(out)]) == 0
    got = load_file(str(out))
    ref = _npz(base, "fsdp", "step3", 0)  # gathered with full_tensor() by the job itself
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight", "seen"]  # weights only
    for k in ("0.weight", "0.bias", "2.weight", "2.bias", "seen"):
        assert np.array_equal(got[k].numpy(), ref[f"m.{k}"]), k
    optim = load_file(str(tmp_path / "optimizer.safetensors"))  # --optimizer: beside them
    assert np.array_equal(optim["state.0.exp_avg_sq"].numpy(), ref["o.0.weight.exp_avg_sq"])


def test_export_dcp_loads_resharded_into_one_process(spawned, tmp_path: Path) -> None:
    """2 ranks' shards -> one unsharded process (no process group): DCP reshards."""
    import torch

    import cudasnap
    from cudasnap.tools.cli import main

    base, _ = spawned
    out = tmp_path / "dcp"
    assert main(["export", str(base / "fsdp_save"), "--to", "dcp", str(out)]) == 0
    assert (out / ".metadata").is_file()
    model, opt = _model_and_opt()
    assert cudasnap.load_resharded(out, model, opt) == 4
    ref = _npz(base, "fsdp", "step3", 0)
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), ref[f"m.{k}"]), k
    names = dict(model.named_parameters())
    for n, p in names.items():
        for k, v in opt.state[p].items():
            assert np.array_equal(v.numpy(), ref[f"o.{n}.{k}"]), (n, k)
    assert opt.param_groups[0]["lr"] == 1e-2  # hyper-parameters come back too
    # Training continues from the loaded state.
    torch.nn.functional.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 4)).backward()
    opt.step()
    assert int(opt.state[names["0.weight"]]["step"]) == 5


@pytest.mark.parametrize("kind", ["fsdp", "fused"])
def test_export_torch_gathers_a_multi_rank_snapshot(spawned, tmp_path: Path, kind: str) -> None:
    """``export --to torch`` of a 2-rank snapshot: the full tensors (it raised a
    CorruptSnapshot for a sound snapshot, issue 32), the real parameters of the fused model
    (loadable by its load pre-hook's path too), every rank's extra."""
    import torch

    from cudasnap.tools.cli import main

    base, _ = spawned
    out = tmp_path / "full.pt"
    assert main(["export", str(base / f"{kind}_save"), "--to", "torch", str(out)]) == 0
    got = torch.load(out, weights_only=False)
    assert got["step"] == 3 and sorted(got["extra_by_rank"]) == [0, 1]
    ref = _npz(base, kind, "step3", 0)
    params = {k[2:] for k in ref if k.startswith("p.")}
    assert params <= set(got["model"]), (sorted(got["model"]), params)
    for k in params:
        assert np.array_equal(got["model"][k].numpy(), ref[f"p.{k}"]), k
    assert np.array_equal(got["model"]["seen"].numpy(), ref["m.seen"])
    if kind == "fused":
        from tools.dist.fused import FusedQKV

        torch.manual_seed(5)
        model = torch.nn.Sequential(FusedQKV(), torch.nn.Linear(6, 4))
        model.register_buffer("seen", torch.zeros(3))
        model.load_state_dict(got["model"])
        assert np.array_equal(model[0].wqkv.detach().numpy(), ref["p.0.wqkv"])


@pytest.mark.parametrize("bad, why", [
    ({"offset": [10, 0]}, "outside its global shape"),
    ({"offset": [0]}, "rank disagrees"),
    ({"placements": ["Shard(0)", "Replicate()"]}, "one string per mesh dimension"),
    ({"global_shape": [13, -16]}, "non-negative integers"),
    ({"mesh_dims": ["dp", "x"]}, "mesh_dims"),
    ({"coord": [True]}, "coord"),
])
def test_a_damaged_shard_entry_is_refused_before_any_data_is_read(bad, why) -> None:
    from cudasnap.errors import CorruptSnapshot
    from cudasnap.format.manifest import validate_tensors

    good = {"global_shape": [13, 16], "mesh_shape": [2], "mesh_dims": ["dp"],
            "placements": ["Shard(0)"], "coord": [1], "offset": [7, 0]}
    shard = {**good, **bad}
    entry = {"name": "model.w", "group": "model:model", "dtype": "float32", "shape": [6, 16],
             "stride": [16, 1], "storage_offset": 0, "offset": 0, "nbytes": 384, "phase": 1,
             "shard": shard}
    with pytest.raises(CorruptSnapshot, match=why):
        validate_tensors([entry], 384, "m")
    validate_tensors([{**entry, "shard": good}], 384, "m")  # the sound one passes
