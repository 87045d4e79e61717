"""``cudasnap export --to safetensors`` of a PEFT (Hugging Face ``peft``) model's snapshot.

A PEFT snapshot (its manifest's ``dcp_names["peft"]``, recorded by cudasnap.core.peft_info)
holds the wrapper's names (``base_model.model.<...>.base_layer.weight``,
``<...>.lora_A.default.weight``): neither ``from_pretrained`` nor ``PeftModel.from_pretrained``
matches them, so the plain safetensors export is not used for it. ``OUT`` is a directory
(created if needed; its parent must exist; a name ending in ``.safetensors`` is refused)
that gets either

* the adapter folder (default), as ``PeftModel.save_pretrained(OUT)`` lays it out:
  ``adapter_model.safetensors`` (PEFT's own keys, from ``get_peft_model_state_dict`` at
  snapshot time: no adapter name, ``modules_to_save`` and trainable tokens included) and
  ``adapter_config.json`` for the adapter ``default``, ``OUT/<name>/`` for each other
  adapter; ``PeftModel.from_pretrained(base_model, OUT)`` loads it
  (``.load_adapter(OUT/<name>, adapter_name=<name>)`` the others); or
* with ``merged=True`` (``--merged``): the base model with the active LoRA adapter(s)
  merged in by PEFT's own ``merge_and_unload()``, on a copy of the model rebuilt offline on
  the meta device from the recorded configs and given the snapshot's tensors:
  ``model.safetensors`` (the base model's own ``state_dict`` keys, a tied weight stored once
  under its first name, as ``save_pretrained`` does) and ``config.json``, which
  ``<BaseModelClass>.from_pretrained(OUT)`` loads. The merge runs on the CPU in the
  snapshot's dtypes: tensor for tensor what ``merge_and_unload()`` gives on the CPU; a merge
  on a GPU may round the last bits differently (another matmul kernel).

Files are written with ``atomic_output`` (0600, fsynced, renamed into place), the weights
before the JSON file that makes the folder loadable. Every check runs before the first write.

Refused (ConfigError, naming the reason and the alternative): a snapshot whose model looks
PEFT-wrapped but has no PEFT record (made before cudasnap recorded one, or a LoRA layer
injected without a ``PeftModel``); an adapter whose record says it cannot be exported
(prompt learning); ``--merged`` of a non-LoRA adapter, a base model that is not a
``transformers`` class, or a quantized one; a snapshot of several models; ``--optimizer``.

Call order: cudasnap.tools.cli (``cmd_export``) -> :func:`peft_record` (the manifest only)
-> :func:`export_adapters` or :func:`export_merged` -> cudasnap.tools.shards (the verified
tensors) -> ``atomic_output``.
"""
from __future__ import annotations

import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..format import paths
from ..storage import posix
from .export import atomic_output, check_export_target
from .shards import _assemble, _chunks, _step_dir, load_shards

log = logging.getLogger("cudasnap.export")

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.CONFIG_NAME
MERGED_WEIGHTS = "model.safetensors"
MERGED_CONFIG = "config.json"
MERGEABLE = frozenset({"LORA"})  # adapter types --merged supports (PEFT's merge, tested)
_ALTERNATIVE = ("--to torch (the wrapper's own state_dict: PeftModel.load_state_dict or "
                "peft.set_peft_model_state_dict read it) or --to dcp")
# names only PEFT's wrappers make: a tuner layer's wrapped module (every LoRA, LoHa, IA3, ...
# layer holds its base as ``base_layer``), trainable token rows, and a modules_to_save copy
# (with its ``original_module``); a hand-written ``lora_A`` alone is a model's own name
_WRAPPED = re.compile(r"\.(base_layer|trainable_tokens_delta|trainable_tokens_original)(\.|$)")
_SAVED_COPY = (".modules_to_save.", ".original_module.")


@dataclass
class Written:
    """What an export wrote (in order) and how to load it (the CLI prints both)."""

    files: list[Path] = field(default_factory=list)
    load: list[str] = field(default_factory=list)


def _manifest(directory: Path, step: int | None) -> dict[str, Any]:
    """The newest (or ``step``'s) committed snapshot's manifest (rank 0's of a multi-rank
    step, or the first rank's present); its data is not read."""
    s = _step_dir(Path(directory), step)
    cands = [s.path] if (s.path / paths.MANIFEST).is_file() else sorted(
        (p for p in s.path.glob("rank-*") if (p / paths.MANIFEST).is_file()),
        key=lambda p: int(p.name.rpartition("-")[2]) if p.name.rpartition("-")[2].isdigit()
        else 1 << 30)
    if not cands:
        raise ConfigError(f"step {s.step} in {directory} has no manifest to read")
    return dict(posix.load_manifest(cands[0] / paths.MANIFEST))


def _records(m: dict[str, Any]) -> dict[str, Any] | None:
    raw = (m.get("dcp_names") or {}).get("peft")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError("the manifest's PEFT record (dcp_names['peft']) is malformed")
    return raw


def _models(m: dict[str, Any]) -> dict[str, list[str]]:
    """{model key: tensor names (aliases included)} of a manifest."""
    out: dict[str, list[str]] = {}
    for e in m["tensors"]:
        kind, _, key = str(e.get("group", "")).partition(":")
        if kind == "model":
            out.setdefault(key, []).extend([e["name"], *e.get("aliases", [])])
    return out


def peft_record(directory: Path, step: int | None = None) -> dict[str, Any] | None:
    """The snapshot's PEFT record (``{model key: record}``), None for a snapshot of no PEFT
    model. Refuses a snapshot whose model names look PEFT-wrapped (``.base_layer.``,
    ``.modules_to_save.`` with ``.original_module.``, trainable tokens) without a record:
    its names match no loader, and writing them would give a model that
    ``from_pretrained`` initialises at random with only a warning."""
    m = _manifest(directory, step)
    rec = _records(m)
    if rec is not None:
        return rec
    for key, names in _models(m).items():
        hit = next((n for n in names if _WRAPPED.search(n[len(key):])), None)
        if hit is None and all(any(c in n for n in names) for c in _SAVED_COPY):
            hit = next(n for n in names if _SAVED_COPY[0] in n)
        if hit is not None:
            raise ConfigError(
                f"cannot export step {m.get('step')} to safetensors: model {key!r} looks "
                f"PEFT-wrapped (tensor {hit!r}) but the snapshot has no PEFT record (made by a "
                "cudasnap without PEFT-aware exports, or adapter layers injected without a "
                "peft.PeftModel), so its names match neither from_pretrained nor "
                f"PeftModel.from_pretrained. Use {_ALTERNATIVE}, or restore it with this "
                "cudasnap, snapshot again and export that")
    return None


def _one(rec: dict[str, Any], m: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    models = sorted(_models(m))
    if len(rec) != 1 or len(models) != 1:
        raise ConfigError(f"the snapshot holds {len(models)} model(s) ({', '.join(models)}), "
                          f"{len(rec)} of them PEFT: the PEFT export writes the snapshot of "
                          f"one PeftModel; use {_ALTERNATIVE}")
    key, r = next(iter(rec.items()))
    if r.get("error"):
        raise ConfigError(f"model {key!r}: {r['error']}; use {_ALTERNATIVE}")
    if r.get("version") != 1 or not isinstance(r.get("adapters"), dict) or not r["adapters"]:
        raise ConfigError(f"model {key!r}: PEFT record version {r.get('version')!r} (or no "
                          f"adapters) is not one this cudasnap reads; use {_ALTERNATIVE}")
    return key, r


def _out_dir(directory: Path, out: Path, files: list[Path], clash: tuple[str, ...],
             what: str) -> None:
    """Checks a PEFT export's directory ``out`` and the ``files`` it will get."""
    out = Path(out)
    if out.suffix == ".safetensors" and not out.is_dir():
        raise ConfigError(f"export target {out}: a PEFT snapshot's export is a folder ({what}); "
                          "give a directory name, not a .safetensors file")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} is a file; give a directory")
    if out.resolve() == Path(directory).resolve():
        raise ConfigError(f"export target {out} is the snapshot directory itself; "
                          "write it elsewhere")
    if not out.is_dir() and not out.parent.is_dir():
        raise ConfigError(f"export target {out}: its directory {out.parent} does not exist")
    for f in files:
        check_export_target(directory, f, need_parent=False)
    for name in clash:
        if (out / name).exists():
            raise ConfigError(f"export target {out} already holds {name}: with {what} beside it "
                              "a loader would read both (an adapter applied to merged weights "
                              "twice); write this export to another directory")


class _Tensors:
    """The verified snapshot's full tensors by any of their names (aliases too)."""

    def __init__(self, directory: Path, step: int | None) -> None:
        self.step, ranks = load_shards(directory, step)
        self.source = str(_step_dir(Path(directory), self.step).path.resolve())
        self.manifest: dict[str, Any] = dict(ranks[0]["manifest"])
        self.chunks = _chunks(ranks)
        self.primary: dict[str, str] = {}
        for name, ent in self.chunks.items():
            self.primary.setdefault(name, name)
            for a in ent["aliases"]:
                self.primary.setdefault(a, name)
        self._full: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        p = self.primary.get(name)
        if p is None:
            raise KeyError(name)
        if p not in self._full:
            self._full[p] = _assemble(p, self.chunks[p])
        return self._full[p]

    def meta(self) -> dict[str, str]:
        return {"format": "pt", "cudasnap_step": str(self.step), "cudasnap_source": self.source,
                "cudasnap_format_version": str(self.manifest.get("format_version", ""))}


def _adapter_dir(out: Path, name: str) -> Path:
    if name == "default":
        return out
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"adapter name {name!r} cannot be a folder name; rename the adapter "
                          f"or use {_ALTERNATIVE}")
    return out / name


def _json_text(d: Any) -> str:
    return json.dumps(d, indent=2, sort_keys=True)


def _write_text(target: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text)

    atomic_output(target, write)


def export_adapters(directory: Path, out: Path, step: int | None = None) -> Written:
    """Writes the adapter folder(s) of a PEFT snapshot into ``out`` (see the module doc)."""
    from safetensors.torch import save_file

    directory, out = Path(directory), Path(out)
    m = _manifest(directory, step)
    rec0 = _records(m)
    if rec0 is None:
        raise ConfigError(f"the snapshot in {directory} has no PEFT model")
    _, r = _one(rec0, m)
    plan: list[tuple[str, Path, dict[str, Any]]] = []
    for name, ad in r["adapters"].items():
        if ad.get("error"):
            raise ConfigError(f"adapter {name!r} ({ad.get('peft_type')}) cannot be exported as "
                              f"an adapter folder: {ad['error']}; use {_ALTERNATIVE}")
        plan.append((name, _adapter_dir(out, name), ad))
    files = [f for _, d, _ in plan for f in (d / ADAPTER_WEIGHTS, d / ADAPTER_CONFIG)]
    _out_dir(directory, out, files, (MERGED_WEIGHTS,), "an adapter folder")
    snap = _Tensors(directory, m.get("step") if step is None else step)
    _, r = _one(_records(snap.manifest) or {}, snap.manifest)  # the verified manifest's
    weights: dict[str, dict[str, Any]] = {}
    for name, _, ad in plan:
        sd: dict[str, Any] = {}
        used: set[str] = set()
        for key, tname in ad["tensors"].items():
            try:
                t = snap.get(tname)
            except KeyError:
                raise ConfigError(f"adapter {name!r}: tensor {tname!r} (saved as {key!r}) is not "
                                  f"in the snapshot; use {_ALTERNATIVE}") from None
            p = snap.primary[tname]
            sd[key] = (t.clone() if p in used else t).contiguous()  # no shared storage
            used.add(p)
        if not sd:
            raise ConfigError(f"adapter {name!r}: PEFT saves no tensor of it; use {_ALTERNATIVE}")
        weights[name] = sd
    written = Written()
    out.mkdir(mode=0o700, exist_ok=True)
    for name, d, ad in plan:
        d.mkdir(mode=0o700, exist_ok=True)
        meta = {**snap.meta(), "cudasnap_adapter": name}
        sd = weights[name]
        atomic_output(d / ADAPTER_WEIGHTS, lambda tmp, sd=sd, meta=meta: save_file(  # type: ignore[misc]
            sd, str(tmp), metadata=meta))
        _write_text(d / ADAPTER_CONFIG, _json_text(ad["config"]))
        written.files += [d / ADAPTER_WEIGHTS, d / ADAPTER_CONFIG]
        how = (f"PeftModel.from_pretrained(base_model, {str(out)!r})" if d == out else
               f"<peft model>.load_adapter({str(d)!r}, adapter_name={name!r})")
        written.load.append(f"adapter {name!r} ({ad.get('peft_type')}, {len(sd)} tensors): {how}")
    if "default" not in r["adapters"]:
        written.load.append(f"no adapter is named 'default': as PeftModel.save_pretrained, "
                            f"each adapter is in its own folder under {out}")
    return written


def _transformers_class(mod: Any, name: Any, module: Any, base: type, what: str) -> Any:
    cls = getattr(mod, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, base)) or (
            module is not None and cls.__module__ != module):
        raise ConfigError(f"--merged: the base model's {what} {name!r} ({module or '?'}) is not "
                          "a class of the installed transformers; a merged export rebuilds the "
                          "model offline from transformers only. Export the adapter folder "
                          "(without --merged) and merge it with PEFT, or use --to torch")
    return cls


def _rebuild(r: dict[str, Any]) -> tuple[Any, Any]:
    """(PeftModel, base class) rebuilt on the meta device from the record."""
    import peft
    import torch
    import transformers

    b = r.get("base") or {}
    if b.get("error"):
        raise ConfigError(f"--merged: {b['error']}; export the adapter folder (without "
                          "--merged) or use --to torch")
    if not isinstance(b.get("config"), dict):
        raise ConfigError("--merged: the PEFT record has no base model config; export the "
                          "adapter folder (without --merged) or use --to torch")
    if b["config"].get("quantization_config"):
        raise ConfigError("--merged: the base model is quantized (quantization_config); a "
                          "merged export of quantized weights is not supported. Export the "
                          "adapter folder (without --merged)")
    cfg_base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    cfg_cls = _transformers_class(transformers, b.get("config_class"), None, cfg_base,
                                  "config class")
    cls = _transformers_class(transformers, b.get("class"), b.get("module"),
                              transformers.PreTrainedModel, "class")
    config = cfg_cls.from_dict(b["config"])
    cfgs = {}
    for name, ad in r["adapters"].items():
        c = peft.PeftConfig.from_peft_type(**ad["config"])
        if getattr(c, "init_lora_weights", True) is not True:
            c.init_lora_weights = True  # the init is replaced by the snapshot's tensors
        cfgs[name] = c
    names = list(cfgs)
    with warnings.catch_warnings(record=True) as caught, torch.device("meta"):
        warnings.simplefilter("always")
        base = cls(config)
        pm = peft.get_peft_model(base, cfgs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            pm.add_adapter(name, cfgs[name])
    for w in caught:
        log.debug("rebuild: %s", w.message)
    return pm, cls


def _load_into(pm: Any, r: dict[str, Any], snap: _Tensors, mkey: str) -> None:
    """The snapshot's tensors put into the rebuilt model (assigned, not copied); a tensor
    with several names (tied) becomes one object again, as it was in training."""
    from ..core import module_state

    prefix, renamed = str(r.get("prefix", f"{mkey}.")), r.get("renamed") or {}
    first: dict[str, str] = {}
    ties: list[tuple[str, str]] = []
    sd: dict[str, Any] = {}
    for k, _, _ in module_state.live(pm):
        name = renamed.get(k, prefix + k)
        p = snap.primary.get(name)
        if p is None:
            raise ConfigError(f"--merged: the model rebuilt from the record has {k!r}, which the "
                              f"snapshot lacks ({name!r}); export the adapter folder (without "
                              f"--merged) or use --to torch")
        if p in first:
            ties.append((k, first[p]))
        else:
            first[p] = k
            sd[k] = snap.get(name)
    extra = sorted(n for n, ent in snap.chunks.items()
                   if ent["group"] == f"model:{mkey}" and n not in first)
    if extra:
        raise ConfigError(f"--merged: the snapshot holds {len(extra)} tensor(s) the model rebuilt "
                          f"from the record lacks (first: {extra[0]!r}); export the adapter "
                          "folder (without --merged) or use --to torch")
    res = pm.load_state_dict(sd, strict=False, assign=True)
    missing = sorted(set(res.missing_keys) - {k for k, _ in ties})
    if missing or res.unexpected_keys:
        raise ConfigError(f"--merged: the rebuilt model does not take the snapshot's tensors "
                          f"(missing {missing[:3]}, unexpected {list(res.unexpected_keys)[:3]}); "
                          "export the adapter folder (without --merged) or use --to torch")
    for k, k0 in ties:
        path, _, attr = k.rpartition(".")
        mod = pm.get_submodule(path)
        p0, _, a0 = k0.rpartition(".")
        mod0 = pm.get_submodule(p0)
        obj = mod0._parameters.get(a0) if a0 in mod0._parameters else mod0._buffers[a0]
        (mod._parameters if attr in mod._parameters else mod._buffers)[attr] = obj


def export_merged(directory: Path, out: Path, step: int | None = None) -> Written:
    """Writes the base model with the active adapter(s) merged (see the module doc)."""
    import torch
    from safetensors.torch import save_file

    directory, out = Path(directory), Path(out)
    m = _manifest(directory, step)
    rec0 = _records(m)
    if rec0 is None:
        raise ConfigError(f"--merged is for a snapshot of a PEFT model; the snapshot in "
                          f"{directory} has none (export it without --merged)")
    _, r = _one(rec0, m)
    bad = {n: a.get("peft_type") for n, a in r["adapters"].items()
           if a.get("peft_type") not in MERGEABLE}
    if bad:
        n, t = next(iter(bad.items()))
        raise ConfigError(f"--merged supports LoRA adapters only: adapter {n!r} is {t}. Export "
                          "the adapter folder (without --merged) and merge it with PEFT "
                          "(merge_and_unload), or use --to torch")
    active = [a for a in r.get("active", []) if a in r["adapters"]]
    if not active:
        raise ConfigError(f"--merged: no active adapter recorded ({r.get('active')}); export "
                          "the adapter folder (without --merged)")
    files = [out / MERGED_WEIGHTS, out / MERGED_CONFIG]
    _out_dir(directory, out, files, (ADAPTER_CONFIG,), "a merged model")
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--merged needs peft and transformers installed ({e}); export the "
                          "adapter folder (without --merged)") from None
    snap = _Tensors(directory, m.get("step") if step is None else step)
    mkey, r = _one(_records(snap.manifest) or {}, snap.manifest)
    try:
        pm, cls = _rebuild(r)
        _load_into(pm, r, snap, mkey)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            if len(active) == 1:
                pm.set_adapter(active[0])
            else:
                pm.base_model.set_adapter(active)
            merged = pm.merge_and_unload()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - PEFT / transformers refused the rebuild
        raise ConfigError(f"--merged: rebuilding {r.get('base', {}).get('class')} with its "
                          f"adapters offline failed ({type(e).__name__}: {e}); export the "
                          "adapter folder (without --merged) and merge it with PEFT") from e
    for w in caught:
        log.info("merge: %s", w.message)
    sd = merged.state_dict()
    weights: dict[str, Any] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for k, t in sd.items():
        if t.is_meta:
            raise ConfigError(f"--merged: {k!r} of the merged model has no value in the snapshot; "
                              "export the adapter folder (without --merged)")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                 tuple(t.stride()), t.dtype)
        if ident in seen:  # a tied weight: stored once, under its first name
            tied[k] = seen[ident]
            continue
        seen[ident] = k
        weights[k] = t.contiguous()
    config = merged.config
    config.architectures = [cls.__name__]  # as save_pretrained writes it
    config_text = config.to_json_string()
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    meta = {**snap.meta(), "cudasnap_dtypes": json.dumps(dtypes),
            "cudasnap_tied": json.dumps(tied, sort_keys=True),
            "cudasnap_merged": json.dumps(active)}
    out.mkdir(mode=0o700, exist_ok=True)
    atomic_output(out / MERGED_WEIGHTS, lambda tmp: save_file(weights, str(tmp), metadata=meta))
    _write_text(out / MERGED_CONFIG, config_text)
    return Written(files=files, load=[
        f"adapter(s) {', '.join(repr(a) for a in active)} merged into {cls.__name__}'s "
        f"{len(weights)} tensors: {cls.__name__}.from_pretrained({str(out)!r})"])
