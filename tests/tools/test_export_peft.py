"""``cudasnap export --to safetensors`` of a PEFT (LoRA) model's snapshot (issue 45 item 3).

A small GPT-2 with two LoRA adapters (``default``: r=32 on c_attn + c_proj, ``ln_f`` in
``modules_to_save``; ``extra``: r=8 on c_fc, randomly initialised) trained 2 steps with
AdamW under cudasnap, flushed. The snapshot's manifest records what the export needs
(cudasnap.core.peft_info); the export writes an adapter folder that
``PeftModel.from_pretrained`` loads bit for bit, or (``--merged``) the base model with the
active adapter merged exactly as ``merge_and_unload()`` computes it, which
``GPT2LMHeadModel.from_pretrained`` loads with every key matched. Exports whose names no
loader matches are refused, nothing written."""
from __future__ import annotations

import copy
import json
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from cudasnap.errors import ConfigError
from cudasnap.format.paths import MANIFEST
from cudasnap.storage import posix
from cudasnap.tools import cli
from tests.helpers.flushed import flushed_snapshot

pytest.importorskip("safetensors", reason="safetensors is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

VOCAB = 128


def _snapshot(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
              step_fn: Any, steps: int = 2) -> Path:
    return flushed_snapshot(directory, model, opt, step_fn, steps, job="tpeft")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bitwise, dtype and shape included
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _unordered(d: dict[str, Any]) -> dict[str, Any]:
    return {k: sorted(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
            for k, v in d.items()}


def _config() -> Any:
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                   n_positions=64, bos_token_id=0, eos_token_id=0)


def _base_sd(config: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in transformers.GPT2LMHeadModel(config).state_dict().items()}


def _base(config: Any, sd: dict[str, torch.Tensor]) -> Any:
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(sd)
    return model


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("peft")
    config = _config()
    base_sd = _base_sd(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_base(config, base_sd), peft.LoraConfig(
            r=32, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
            modules_to_save=["ln_f"]))
        model.add_adapter("extra", peft.LoraConfig(
            r=8, lora_alpha=8, target_modules=["c_fc"], fan_in_fan_out=True,
            init_lora_weights=False))
    assert model.active_adapters == ["default"]
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(input_ids=x, labels=x).loss.backward()

    ckpt = tmp / "ckpt"
    step_dir = _snapshot(ckpt, model, opt, step)
    model.eval()
    return {"config": config, "base_sd": base_sd, "model": model, "ckpt": ckpt, "x": x,
            "step_dir": step_dir, "tmp": tmp}


def _record(step_dir: Path) -> dict[str, Any]:
    return posix.load_manifest(step_dir / MANIFEST)["dcp_names"]["peft"]


def test_manifest_records_what_the_export_needs(lora) -> None:
    rec = _record(lora["step_dir"])
    assert list(rec) == ["model"]
    r = rec["model"]
    assert r["version"] == 1 and r["prefix"] == "model." and r["renamed"] == {}
    assert r["active"] == ["default"] and list(r["adapters"]) == ["default", "extra"]
    assert r["base"]["class"] == "GPT2LMHeadModel" and r["base"]["config"]["n_embd"] == 64
    d = r["adapters"]["default"]
    assert d["peft_type"] == "LORA" and d["config"]["r"] == 32
    assert d["config"]["target_modules"] == ["c_attn", "c_proj"]  # a set, as a sorted list
    assert d["config"]["inference_mode"] is True  # as save_pretrained writes it
    # PEFT's own saved keys -> the snapshot's tensor names
    assert d["tensors"]["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"] == \
        "model.base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"
    assert d["tensors"]["base_model.model.transformer.ln_f.weight"] == \
        "model.base_model.model.transformer.ln_f.modules_to_save.default.weight"
    want = {k for k in peft.get_peft_model_state_dict(lora["model"], adapter_name="default")}
    assert set(d["tensors"]) == want
    assert set(r["adapters"]["extra"]["tensors"]) == set(
        peft.get_peft_model_state_dict(lora["model"], adapter_name="extra"))


def test_adapter_export_loads_with_peft_bitwise(lora, capsys) -> None:
    out = lora["tmp"] / "adapter"
    assert cli.main(["export", str(lora["ckpt"]), "--to", "safetensors", str(out)]) == 0
    said = capsys.readouterr().out
    for f in ("adapter_model.safetensors", "adapter_config.json",
              "extra/adapter_model.safetensors", "extra/adapter_config.json"):
        assert f"wrote {out / f}" in said
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o600
    assert "PeftModel.from_pretrained" in said
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors", "extra"]
    model = lora["model"]
    # the same keys as PEFT's own save_pretrained writes
    ref = lora["tmp"] / "ref"
    model.save_pretrained(ref)
    for sub in ("", "extra"):
        got, want = load_file(str(out / sub / "adapter_model.safetensors")), load_file(
            str(ref / sub / "adapter_model.safetensors"))
        assert sorted(got) == sorted(want)
        assert [k for k in want if not _same(got[k], want[k])] == []
        # the same adapter_config.json (PEFT writes a set in hash order, cudasnap sorted)
        assert _unordered(json.loads((out / sub / "adapter_config.json").read_text())) == \
            _unordered(json.loads((ref / sub / "adapter_config.json").read_text()))

    loaded = peft.PeftModel.from_pretrained(_base(lora["config"], lora["base_sd"]), out)
    loaded.load_adapter(out / "extra", adapter_name="extra")
    loaded.eval()
    want_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    assert [k for k in want_sd if not _same(got_sd[k], want_sd[k])] == []
    with torch.no_grad():
        assert _same(loaded(input_ids=lora["x"]).logits, model(input_ids=lora["x"]).logits)


def test_merged_export_equals_merge_and_unload(lora, capsys) -> None:
    out = lora["tmp"] / "merged"
    assert cli.main(["export", str(lora["ckpt"]), "--to", "safetensors", "--merged",
                     str(out)]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out / 'model.safetensors'}" in said and f"wrote {out / 'config.json'}" in said
    assert "GPT2LMHeadModel.from_pretrained" in said
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = copy.deepcopy(lora["model"]).merge_and_unload()
    want = ref.state_dict()
    stored = load_file(str(out / "model.safetensors"))
    assert sorted(stored) == sorted(set(want) - {"lm_head.weight"})  # the tied head once
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["cudasnap_tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    assert json.loads(meta["cudasnap_merged"]) == ["default"]

    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info.get("error_msgs"), info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # re-tied
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not _same(got[k], want[k])] == []
    # the merge changed what LoRA targets and the modules_to_save copy, nothing else
    base = lora["base_sd"]
    changed = sorted(k for k in want if not _same(want[k], base[k]))
    assert "transformer.h.0.attn.c_attn.weight" in changed and "transformer.ln_f.weight" in changed
    assert "transformer.h.0.mlp.c_fc.weight" not in changed  # 'extra' is not active
    loaded.eval()
    with torch.no_grad():
        assert _same(loaded(input_ids=lora["x"]).logits, ref(input_ids=lora["x"]).logits)
        # the unmerged model adds x @ (B A) to x @ W: the same function, another rounding
        torch.testing.assert_close(loaded(input_ids=lora["x"]).logits,
                                   lora["model"](input_ids=lora["x"]).logits,
                                   rtol=1e-5, atol=1e-5)


def test_refusals_write_nothing(lora, capsys) -> None:
    ckpt, tmp = lora["ckpt"], lora["tmp"]

    def refused(args: list[str], *needles: str) -> None:
        assert cli.main(["export", str(ckpt), *args]) == 2
        err = capsys.readouterr().err
        for n in needles:
            assert n in err, err

    refused(["--to", "safetensors", str(tmp / "w.safetensors")], "is a folder")
    assert not (tmp / "w.safetensors").exists()
    refused(["--to", "safetensors", "--optimizer", str(tmp / "o")], "--optimizer", "--to torch")
    refused(["--to", "torch", "--merged", str(tmp / "t.pt")], "--merged is for --to safetensors")
    # a merged export beside an adapter folder: from_pretrained would apply it twice
    both = tmp / "both"
    assert cli.main(["export", str(ckpt), "--to", "safetensors", str(both)]) == 0
    capsys.readouterr()
    refused(["--to", "safetensors", "--merged", str(both)], "adapter_config.json")
    assert not (both / "model.safetensors").exists()
    assert not list(tmp.glob("o")) and not (tmp / "t.pt").exists()
    # the Python API's plain safetensors export refuses it too (the CLI picks export_peft)
    from cudasnap.tools.export import export_safetensors

    with pytest.raises(ConfigError, match="a snapshot of a PEFT model.*export_adapters"):
        export_safetensors(ckpt, tmp / "api.safetensors")
    assert not (tmp / "api.safetensors").exists()


def _rewrite_record(src: Path, dst: Path, edit: Any) -> None:
    """A copy of the snapshot directory ``src`` whose manifest's PEFT record ``edit``
    changes (None: removed, as in a snapshot made before cudasnap recorded it)."""
    import shutil

    from cudasnap.format.manifest import MANIFEST_CRC, manifest_crc

    shutil.copytree(src, dst)
    mpath = next(dst.glob(f"*/{MANIFEST}"))
    m = json.loads(mpath.read_text())
    rec = m["dcp_names"].pop("peft")
    new = edit(rec)
    if new is not None:
        m["dcp_names"]["peft"] = new
    m[MANIFEST_CRC] = manifest_crc(m)
    mpath.write_text(json.dumps(m))


def test_snapshot_without_record_is_refused(lora, capsys) -> None:
    old = lora["tmp"] / "old"
    _rewrite_record(lora["ckpt"], old, lambda rec: None)
    out = lora["tmp"] / "old-out"
    assert cli.main(["export", str(old), "--to", "safetensors", str(out)]) == 2
    err = capsys.readouterr().err
    assert "looks PEFT-wrapped" in err and "no PEFT record" in err and "--to torch" in err
    assert "lora_A.default.weight" in err or "base_layer" in err
    assert not out.exists()
    assert cli.main(["export", str(old), "--to", "safetensors", "--merged", str(out)]) == 2
    assert "no PEFT record" in capsys.readouterr().err and not out.exists()
    # --to torch still writes the wrapper's names (PeftModel.load_state_dict reads them)
    assert cli.main(["export", str(old), "--to", "torch", str(lora["tmp"] / "old.pt")]) == 0


def test_unsupported_adapter_types_are_refused(lora, capsys) -> None:
    def as_type(rec: dict[str, Any]) -> dict[str, Any]:
        for ad in rec["model"]["adapters"].values():
            ad["peft_type"] = "IA3"
        return rec

    ia3 = lora["tmp"] / "ia3"
    _rewrite_record(lora["ckpt"], ia3, as_type)
    out = lora["tmp"] / "ia3-out"
    assert cli.main(["export", str(ia3), "--to", "safetensors", "--merged", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--merged supports LoRA adapters only" in err and "'default' is IA3" in err
    assert not out.exists()

    def prompt(rec: dict[str, Any]) -> dict[str, Any]:
        rec["model"]["adapters"]["extra"]["error"] = "PROMPT_TUNING is a prompt-learning method"
        return rec

    pt = lora["tmp"] / "prompt"
    _rewrite_record(lora["ckpt"], pt, prompt)
    assert cli.main(["export", str(pt), "--to", "safetensors", str(out)]) == 2
    err = capsys.readouterr().err
    assert "adapter 'extra'" in err and "prompt-learning" in err and "--to torch" in err
    assert not out.exists()


def test_plain_model_unchanged_and_merged_refused(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    ckpt = tmp_path / "ckpt"
    _snapshot(ckpt, model, opt, lambda: model(x).sum().backward())
    assert "peft" not in posix.load_manifest(next(ckpt.glob(f"*/{MANIFEST}")))["dcp_names"]
    assert cli.main(["export", str(ckpt), "--to", "safetensors", "--merged",
                     str(tmp_path / "m")]) == 2
    assert "holds none" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert cli.main(["export", str(ckpt), "--to", "safetensors", str(tmp_path / "p")]) == 0
    assert sorted(load_file(str(tmp_path / "p" / "model.safetensors"))) == sorted(
        model.state_dict())


def _train_and_snapshot(directory: Path, model: Any) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    _snapshot(directory, model, opt, lambda: model(input_ids=x, labels=x).loss.backward())


@pytest.mark.parametrize("variant", ["dora", "trainable_tokens", "two_active"])
def test_lora_variants_match_save_pretrained_and_merge(variant, tmp_path, capsys) -> None:
    """DoRA (its magnitude vector's saved key drops ``.weight``), LoRA with trainable token
    rows, two active adapters merged together: PEFT's own files and merge, bit for bit."""
    config = _config()
    lora_kw: dict[str, Any] = {"r": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    if variant == "dora":
        lora_kw["use_dora"] = True
    if variant == "trainable_tokens":
        lora_kw["trainable_token_indices"] = [1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_base(config, _base_sd(config)), peft.LoraConfig(**lora_kw))
        if variant == "two_active":
            model.add_adapter("b", peft.LoraConfig(r=4, target_modules=["c_fc"],
                                                   fan_in_fan_out=True, init_lora_weights=False))
            model.base_model.set_adapter(["default", "b"])
    _train_and_snapshot(tmp_path / "ckpt", model)
    out, ref = tmp_path / "adapter", tmp_path / "ref"
    assert cli.main(["export", str(tmp_path / "ckpt"), "--to", "safetensors", str(out)]) == 0
    model.save_pretrained(ref)
    for sub in ("", "b") if variant == "two_active" else ("",):
        got, want = (load_file(str(d / sub / "adapter_model.safetensors")) for d in (out, ref))
        assert sorted(got) == sorted(want)
        assert [k for k in want if not _same(got[k], want[k])] == []
    merged = tmp_path / "merged"
    assert cli.main(["export", str(tmp_path / "ckpt"), "--to", "safetensors", "--merged",
                     str(merged)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_sd = copy.deepcopy(model).merge_and_unload().state_dict()
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got_sd = loaded.state_dict()
    assert [k for k in want_sd if not _same(got_sd[k], want_sd[k])] == []
    capsys.readouterr()


def test_prompt_tuning_is_recorded_and_refused(tmp_path, capsys) -> None:
    """A prompt-learning adapter's saved tensor is computed by its encoder: the record says
    so at snapshot time and the export refuses it, naming the alternative."""
    config = _config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_base(config, _base_sd(config)), peft.PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4))
    _train_and_snapshot(tmp_path / "ckpt", model)
    rec = _record(next((tmp_path / "ckpt").glob("step-*")))["model"]
    assert "prompt-learning" in rec["adapters"]["default"]["error"]
    out = tmp_path / "out"
    for extra in ([], ["--merged"]):
        assert cli.main(["export", str(tmp_path / "ckpt"), "--to", "safetensors", *extra,
                         str(out)]) == 2
        err = capsys.readouterr().err
        assert ("prompt-learning" in err or "LoRA adapters only" in err) and "--to torch" in err
        assert not out.exists()


def test_a_models_own_lora_names_are_not_refused(tmp_path) -> None:
    """A hand-written LoRA (its own ``lora_A`` / ``lora_B`` modules, no PEFT) exports as any
    plain model: only names PEFT's wrappers make (``base_layer`` ...) are refused."""

    class Lora(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.lora_A = torch.nn.Linear(4, 2, bias=False)
            self.lora_B = torch.nn.Linear(2, 4, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) + self.lora_B(self.lora_A(x))

    torch.manual_seed(0)
    model = Lora()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    _snapshot(tmp_path / "ckpt", model, opt, lambda: model(x).sum().backward())
    assert cli.main(["export", str(tmp_path / "ckpt"), "--to", "safetensors",
                     str(tmp_path / "out")]) == 0
    assert sorted(load_file(str(tmp_path / "out" / "model.safetensors"))) == sorted(
        model.state_dict())
