"""``cudasnap export --to safetensors`` as Hugging Face reads it (issue 22 item 4): the model's
weights only, under its own ``state_dict`` keys, a tied weight stored once (as
``save_pretrained`` does), metadata with ``format: pt``, the step, dtypes and the source
snapshot; the optimizer state only with ``--optimizer``, in ``optimizer.safetensors``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cudasnap.format.paths import MANIFEST
from cudasnap.storage import posix
from cudasnap.tools import cli
from tests.helpers.flushed import flushed_snapshot

pytest.importorskip("safetensors", reason="safetensors is not installed "
                    "(see requirements-extras.txt)")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _snapshot(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
              step_fn: Any, steps: int = 2) -> Path:
    return flushed_snapshot(directory, model, opt, step_fn, steps, job="texport")


def _meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bitwise, dtype and shape included
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small GPT-2 (tied LM head) trained 2 steps with AdamW under cudasnap, flushed."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(see requirements-extras.txt)")
    tmp = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(x, labels=x).loss.backward()

    ckpt = tmp / "ckpt"
    step_dir = _snapshot(ckpt, model, opt, step)
    return {"tf": transformers, "config": config, "model": model, "opt": opt, "ckpt": ckpt,
            "step_dir": step_dir, "tmp": tmp}


def test_gpt2_export_loads_with_from_pretrained_bitwise(gpt2, capsys) -> None:
    tf, model, out = gpt2["tf"], gpt2["model"], gpt2["tmp"] / "hf"
    gpt2["config"].save_pretrained(out)
    assert cli.main(["export", str(gpt2["ckpt"]), "--to", "safetensors", str(out)]) == 0
    assert str(out / "model.safetensors") in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    want = model.state_dict()
    st = out / "model.safetensors"
    got = load_file(str(st))
    # The model's own keys (no "model." prefix, no optimizer state), the tied head once.
    assert sorted(got) == sorted(set(want) - {"lm_head.weight"})
    meta = _meta(st)
    assert meta["format"] == "pt" and meta["cudasnap_step"] == "1"
    assert Path(meta["cudasnap_source"]) == gpt2["step_dir"].resolve()
    assert json.loads(meta["cudasnap_dtypes"]) == ["float32"]
    assert json.loads(meta["cudasnap_tied"]) == {"lm_head.weight": "transformer.wte.weight"}

    loaded, info = tf.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info.get("error_msgs"), info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # re-tied
    sd = loaded.state_dict()
    assert sorted(sd) == sorted(want)
    bad = [k for k in want if not _same(sd[k], want[k])]
    assert bad == [], bad

    # A strict load_state_dict of the file, the tied names put back from the metadata.
    fresh = tf.GPT2LMHeadModel(gpt2["config"])
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        fresh.load_state_dict(got)  # strict: the dropped alias is missing
    tied = json.loads(meta["cudasnap_tied"])
    fresh.load_state_dict({**got, **{k: got[v] for k, v in tied.items()}})
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    sd = fresh.state_dict()
    assert [k for k in want if not _same(sd[k], want[k])] == []


def test_gpt2_optimizer_file_only_with_the_flag(gpt2, capsys) -> None:
    opt, ckpt, tmp = gpt2["opt"], gpt2["ckpt"], gpt2["tmp"]
    plain = tmp / "plain"
    assert cli.main(["export", str(ckpt), "--to", "safetensors", str(plain)]) == 0
    assert not (plain / "optimizer.safetensors").exists()

    out = tmp / "with-optim"
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), "--to", "safetensors", "--optimizer", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / "model.safetensors") in printed and str(out / "optimizer.safetensors") in printed
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(load_file(str(plain / "model.safetensors")))
    assert not any(k.startswith(("state.", "optim.")) for k in weights)

    osf = out / "optimizer.safetensors"
    got = load_file(str(osf))
    want = opt.state_dict()
    flat = {f"state.{i}.{k}": v for i, st in want["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}
    assert sorted(got) == sorted(flat)
    assert [k for k in flat if not _same(got[k], flat[k])] == []
    meta = _meta(osf)
    assert meta["format"] == "pt" and meta["cudasnap_step"] == "1"
    assert json.loads(meta["optimizer_class"]) == "AdamW"
    groups = json.loads(meta["param_groups"])
    assert groups == json.loads(json.dumps(want["param_groups"]))  # betas: a list in JSON

    # The optimizer state dict rebuilt from the file loads into a fresh AdamW.
    fresh = gpt2["tf"].GPT2LMHeadModel(gpt2["config"])
    o2 = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    state: dict[int, dict[str, Any]] = {}
    for k, v in got.items():
        _, i, key = k.split(".", 2)
        state.setdefault(int(i), {})[key] = v
    for i, key, v in json.loads(meta["scalar_state"]):
        state.setdefault(int(i), {})[key] = v
    o2.load_state_dict({"state": state, "param_groups": groups})
    re = o2.state_dict()
    assert json.dumps(re["param_groups"]) == json.dumps(want["param_groups"])  # JSON: no tuples
    assert all(_same(re["state"][i][k], v) for i, st in want["state"].items()
               for k, v in st.items())


def test_optimizer_flag_is_refused_for_other_formats(gpt2, capsys) -> None:
    capsys.readouterr()
    rc = cli.main(["export", str(gpt2["ckpt"]), "--to", "torch", "--optimizer",
                   str(gpt2["tmp"] / "x.pt")])
    assert rc == 2 and "--optimizer is for --to safetensors" in capsys.readouterr().err
    assert not (gpt2["tmp"] / "x.pt").exists()


class _Wrapper(torch.nn.Module):
    """A model whose own state_dict keys start with ``model.`` (as many HF models' do)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 6))
        self.emb = torch.nn.Embedding(6, 6)
        self.head = torch.nn.Linear(6, 6, bias=False)
        self.head.weight = self.emb.weight  # tied: stored once, as emb.weight
        self.register_buffer("seen", torch.arange(3.0))


def test_file_target_keys_and_prefix_stripped_once(snap_env, capsys) -> None:
    """A ``.safetensors`` target is the weights file; cudasnap's prefix is stripped once,
    so a model's own ``model.`` keys stay; the optimizer file goes beside it."""
    torch.manual_seed(3)
    model = _Wrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 6)
    step_dir = _snapshot(snap_env.dir, model, opt,
                         lambda: model.head(model.model(x) + model.emb.weight[0]).square().mean()
                         .backward())
    names = [e["name"] for e in json.loads((step_dir / MANIFEST).read_text())["tensors"]]
    assert "model.model.0.weight" in names  # cudasnap's prefix on the model's own
    out = snap_env.tmp / "export" / "weights.safetensors"
    assert cli.main(["export", str(snap_env.dir), "--to", "safetensors", "--optimizer",
                     str(out)]) == 0
    got = load_file(str(out))
    want = model.state_dict()
    assert sorted(got) == sorted(set(want) - {"head.weight"}) and "model.0.weight" in got
    assert [k for k in got if not _same(got[k], want[k])] == []
    tied = json.loads(_meta(out)["cudasnap_tied"])
    assert tied == {"head.weight": "emb.weight"}
    fresh = _Wrapper()
    fresh.load_state_dict({**got, **{k: got[v] for k, v in tied.items()}})  # strict
    assert [k for k in want if not _same(fresh.state_dict()[k], want[k])] == []
    optim = load_file(str(out.with_name("optimizer.safetensors")))
    n = len(list(model.parameters()))  # the tied weight is one parameter
    assert sorted(optim) == sorted(f"state.{i}.momentum_buffer" for i in range(n))
    assert posix.list_snapshots(snap_env.dir)[0].step == 1


def test_export_into_the_snapshot_directory_is_refused(snap_env, capsys) -> None:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _snapshot(snap_env.dir, model, opt, lambda: model(torch.ones(1, 3)).sum().backward(), 1)
    before = sorted(p.name for p in snap_env.dir.iterdir())
    for target in (snap_env.dir, snap_env.dir / "step-00000000" / "w.safetensors"):
        capsys.readouterr()
        assert cli.main(["export", str(snap_env.dir), "--to", "safetensors", str(target)]) == 2
        assert "export target" in capsys.readouterr().err
    assert sorted(p.name for p in snap_env.dir.iterdir()) == before
