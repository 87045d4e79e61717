"""``cudasnap export`` of torchtitan's tensor-parallel and pipeline-parallel snapshots (issue 45
item 2), on 2 CPU ranks over gloo (tools/stacks/titan_cpu.py), checked against torchtitan's
own checkpoints of the same step:

- TP 2 (``_StridedShard(dim=0, sf=2)`` on a size-1 dp mesh dim, ``Shard(0)``/``Shard(1)`` on
  tp) and PP 2 (two stages per rank, each rank its own parameters and optimizer indices):
  ``export --to dcp``, then torchtitan's own CheckpointManager loads it
  (``--checkpoint.initial_load_path``, not model-only) and continues to step 8 bitwise as
  from torchtitan's own checkpoint of step 6 on the same layout;
- resharded: the PP 2 export loaded into an FSDP 2 run and continued to step 8, bitwise as
  the same FSDP 2 run loading torchtitan's own PP 2 checkpoint of step 6 (the dataloader is
  excluded from both loads: PP 2 has one data-parallel rank, FSDP 2 asks for two);
- ``export --to torch``: full tensors equal torchtitan's own DCP checkpoint of step 6 read
  with ``dcp_to_torch_save`` (the fused ``wqkv`` compared through torchtitan's own split keys,
  every optimizer moment by parameter FQN).

Runs are shared through module fixtures (10 torchtitan runs in all)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_torchtitan import (
    CUDASNAP_CFG,
    REPO,
    STEPS,
    _env,
    _load,
    _remove_arenas,
    _run,
    _torchrun,
    assets,  # noqa: F401  (a module fixture)
)

pytestmark = pytest.mark.slow

PAR = {"tp": ["--parallelism.data_parallel_shard_degree", "1",
              "--parallelism.tensor_parallel_degree", "2"],
       "pp": ["--parallelism.data_parallel_shard_degree", "1",
              "--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"],
       "fsdp": []}  # _torchrun's own --parallelism.data_parallel_shard_degree 2
OWN = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS),
       "--checkpoint.no-last_save_model_only"]
TO8 = ["--training.steps", "8"]
TITAN = ("llama3", "llama3_debugmodel")


def _titan(made: Path, out: Path, par: str, extra: list[str], job: str,
           config: tuple[str, str] = TITAN, **env: str) -> str:
    """One torchtitan run on layout ``par`` (assets ``made``); its log (it succeeded)."""
    try:
        rc, log, secs = _run(_torchrun(made, out, config, 0) + PAR[par] + extra,
                             _env(out.parent, job, **env))
    finally:
        _remove_arenas(job)
    assert rc == 0, log[-5000:]
    print(f"[{job}] {secs:.1f} s")
    return log


def _export(snap: Path, to: str, out: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "cudasnap", "export", str(snap), "--to", to,
                        str(out)], env=_env(out.parent, "x"), capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "built by hooks" not in p.stderr


@pytest.fixture(scope="module", params=["tp", "pp"])
def layout(request: pytest.FixtureRequest, assets: Path,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """On one layout: torchtitan's own checkpoint of step 6 (``own``) continued to step 8
    (dump ``a``); a cudasnap run to step 6 (``snap``), its ``--to dcp`` export continued to
    step 8 by torchtitan's CheckpointManager (dump ``b``) and its ``--to torch`` export."""
    par = request.param
    w = tmp_path_factory.mktemp(f"titan-{par}")
    job = f"tx{par}{os.getpid()}"
    _titan(assets, w / "own", par, OWN, f"{job}o")
    log = _titan(assets, w / "own", par, OWN + TO8, f"{job}a", TT_DUMP=str(w / "a"))
    assert "Loading the checkpoint" in log, log[-3000:]
    _titan(assets, w / "snap", par, [], f"{job}s", CUDASNAP_CFG, CUDASNAP_DIR=str(w / "ckpt"))
    _export(w / "ckpt", "dcp", w / "dcp")
    _export(w / "ckpt", "torch", w / "full.pt")
    log = _titan(assets, w / "cont", par, ["--checkpoint.enable", "--checkpoint.initial_load_path",
                                           str(w / "dcp"), "--checkpoint.no-initial_load_model_only"]
                 + TO8, f"{job}b", TT_DUMP=str(w / "b"))
    assert "Loading the checkpoint" in log, log[-3000:]
    return {"par": par, "dir": w, "own_step": w / "own" / "checkpoint" / f"step-{STEPS}"}


def _same_dumps(a: Path, b: Path) -> None:
    import torch

    for rank in (0, 1):
        x, y = _load(a, rank), _load(b, rank)
        assert x["info"]["step"] == y["info"]["step"] == 8
        assert x["tensors"].keys() == y["tensors"].keys()
        assert any(k.startswith("optim") and k.endswith("exp_avg_sq") for k in x["tensors"])
        differ = [k for k in x["tensors"] if not torch.equal(x["tensors"][k], y["tensors"][k])]
        assert differ == [], f"rank {rank}: {len(differ)} tensors differ, e.g. {differ[:3]}"
        assert x["info"] == y["info"], (rank, x["info"], y["info"])


def test_torchtitan_continues_bitwise_from_the_dcp_export(layout: dict[str, Any]) -> None:
    """TP 2 / PP 2: the export continued by torchtitan == its own checkpoint continued."""
    _same_dumps(layout["dir"] / "a", layout["dir"] / "b")


def _own_full(step_dir: Path, tmp: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp / "own.pt"))  # its optimizer nested again
    return flatten_state_dict(torch.load(tmp / "own.pt", weights_only=False))[0]


def test_export_torch_gives_the_full_tensors_of_torchtitans_checkpoint(
        layout: dict[str, Any], tmp_path: Path) -> None:
    """``--to torch``: every model tensor (``wqkv`` through torchtitan's own wq/wk/wv keys,
    split as its hook does) and every optimizer moment (by the FQN in ``param_names``) equals
    torchtitan's own checkpoint of the same step; the PP stages merged into one state_dict."""
    import torch

    from cudasnap.tools.dcp_views import compute

    own = _own_full(layout["own_step"], tmp_path)
    full = torch.load(layout["dir"] / "full.pt", weights_only=False)
    model = full["model"]
    assert "tok_embeddings.weight" in model and "lm_head.weight" in model  # stages merged
    compared = 0
    for k, v in model.items():
        if k.endswith("wqkv.weight"):
            base = k.rpartition("wqkv.weight")[0]
            spec = {"kind": "fused_qkv", "head_dim": 16, "heads_per_kv": 1,
                    "names": [f"{base}{x}.weight" for x in ("wq", "wk", "wv")]}
            parts = dict(zip(spec["names"], compute(v, spec, k)))
        else:
            parts = {k: v}
        for name, t in parts.items():
            assert torch.equal(t, own[name]), name
            compared += 1
    assert compared == len([k for k in own if k.count(".") >= 1 and not k.startswith(
        ("optimizer.", "lr_scheduler.", "dataloader.", "train_state."))])
    optims = full["optimizer"]
    optims = optims if "state" not in optims else {"optim": optims}
    moments = 0
    for o in optims.values():
        names = {i: n for g in o["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        for i, st in o["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(st[key], own[f"optimizer.state.{names[i]}.{key}"]), \
                    (names[i], key)
                moments += 1
    assert moments == len([k for k in own if k.startswith("optimizer.state.")])


@pytest.fixture(scope="module")
def resharded(assets: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
              layout: dict[str, Any]) -> Path:
    """PP 2 -> FSDP 2: torchtitan's own PP checkpoint of step 6 (dump ``r_own``) and the PP
    export (dump ``r_exp``), each loaded by an FSDP 2 run and continued to step 8."""
    if layout["par"] != "pp":
        pytest.skip("the resharded case starts from the PP 2 layout")
    w = tmp_path_factory.mktemp("titan-pp-fsdp")
    load = ["--checkpoint.enable", "--checkpoint.no-initial_load_model_only",
            "--checkpoint.exclude_from_loading", "dataloader", "--checkpoint.initial_load_path"]
    for name, src in (("r_own", layout["own_step"]), ("r_exp", layout["dir"] / "dcp")):
        log = _titan(assets, w / name, "fsdp", [*load, str(src), *TO8],
                     f"txr{name}{os.getpid()}", TT_DUMP=str(w / name))
        assert "Loading the checkpoint" in log, log[-3000:]
    return w


def test_pp_export_reshards_into_an_fsdp_run_bitwise(resharded: Path) -> None:
    _same_dumps(resharded / "r_own", resharded / "r_exp")
