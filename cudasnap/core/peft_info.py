"""What a PEFT (Hugging Face ``peft``) model's export needs, recorded with the layout.

Owned by the PEFT export work (issue 45 item 3): ``describe`` is called by
``TrainingState.dcp_names`` at each layout build; its result is stored in the manifest's
``dcp_names["peft"]`` and read offline by ``cudasnap export`` (cudasnap.tools.export_peft).

A registered model is a PEFT model when it (or the module a ``DistributedDataParallel`` /
``torch.compile`` wrapper holds) has a ``peft_config`` mapping and a ``base_model``, and
``peft`` is already imported (it is: the model is one); ``peft`` is never imported for any
other model, and ``import cudasnap`` imports neither ``peft`` nor ``transformers``.

The record of one model (``RECORD_VERSION`` 1), plain JSON::

    {"version": 1,
     "prefix": "model.",          # snapshot name of the PeftModel's state key k: prefix + k
     "renamed": {k: name},        # ... except these (a wrapper renamed them; usually empty)
     "active": ["default"],       # the active adapter(s)
     "adapters": {adapter name: {
         "peft_type": "LORA",
         "config": {...},         # adapter_config.json exactly as PeftConfig.save_pretrained
                                  # writes it (sets as sorted lists, inference_mode true,
                                  # base_model_name_or_path and auto_mapping filled in)
         "tensors": {saved key: snapshot tensor name},  # adapter_model.safetensors' keys, as
                                  # get_peft_model_state_dict names them
         "error": "..."}},        # only when this adapter cannot be exported (and why)
     "base": {"class": "GPT2LMHeadModel", "module": "transformers.models.gpt2...",
              "config_class": "GPT2Config", "config": {...}},  # config.to_dict() as JSON
     "error": "..."}              # only when nothing of the model can be exported (and why)

The saved keys come from PEFT's own ``get_peft_model_state_dict`` run on the live
parameters (never ``state_dict()``, which a hook may turn into a collective): each returned
value is matched to a snapshot tensor by identity, so PEFT's key rules (the adapter name
removed, ``modules_to_save`` and trainable-token keys) are PEFT's, not a copy of them. The
name mapping is cached per model object while its tensors, adapters and active adapters
are the same objects; the configs are re-read at each call (cheap: a dataclass to dict).
"""
from __future__ import annotations

import enum
import json
import logging
import re
import sys
import weakref
from collections.abc import Mapping
from typing import Protocol, cast

import torch

from . import module_state

log = logging.getLogger("cudasnap")

RECORD_VERSION = 1
_WRAPPER_ATTRS = ("module", "_orig_mod")  # DDP / FSDP1 wrappers, torch.compile

_Names = dict[str, tuple[dict[str, str], "str | None"]]  # {adapter: (tensors, error)}
# per model object: (fingerprint, _Names) of the name mapping
_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[object, ...], _Names]] = (
    weakref.WeakKeyDictionary())


class AdapterConfig(Protocol):
    """What is read of a ``peft.PeftConfig``."""

    peft_type: object

    def to_dict(self) -> dict[str, object]: ...


class PeftLike(Protocol):
    """What is read of a ``peft.PeftModel``."""

    peft_config: Mapping[str, AdapterConfig]
    base_model: torch.nn.Module

    def get_base_model(self) -> torch.nn.Module: ...


def is_peft_model(mod: object) -> bool:
    """Duck-typed: a ``peft.PeftModel`` (``peft_config`` mapping + ``base_model``), without
    importing ``peft`` for any other object."""
    return (isinstance(getattr(mod, "peft_config", None), Mapping)
            and isinstance(getattr(mod, "base_model", None), torch.nn.Module)
            and "peft" in sys.modules)


def find_peft(mod: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(path from ``mod``, the PeftModel) when ``mod`` is a PEFT model or wraps one
    (``.module``, ``._orig_mod``, up to three levels); None otherwise."""
    path = ""
    for _ in range(4):
        if is_peft_model(mod):
            return path, mod
        for attr in _WRAPPER_ATTRS:
            inner = mod._modules.get(attr)
            if isinstance(inner, torch.nn.Module):
                path, mod = f"{path}{attr}.", inner
                break
        else:
            return None
    return None


def describe(models: Mapping[str, torch.nn.Module]) -> dict[str, object]:
    """``{model key: JSON-able record}`` for each registered PEFT model; empty for none.

    Never raises for a PEFT model it cannot read: the record then holds ``"error"`` (the
    reason), and the export refuses, naming it."""
    out: dict[str, object] = {}
    for mkey, mod in models.items():
        found = find_peft(mod)
        if found is None:
            continue
        path, pm = found
        try:
            out[mkey] = _record(mkey, mod, path, pm)
        except Exception as e:  # noqa: BLE001 - the snapshot goes on; the export refuses
            log.warning("PEFT model %r: its export record could not be made (%s: %s); "
                        "cudasnap export --to safetensors will refuse it", mkey,
                        type(e).__name__, e)
            out[mkey] = {"version": RECORD_VERSION,
                         "error": f"the PEFT record could not be made: {type(e).__name__}: {e}"}
    return out


def plain(value: object) -> object:
    """``value`` as plain JSON data: sets as sorted lists, tuples as lists, enums (PEFT's
    ``PeftType``, ``TaskType``: str enums) as their value, a torch dtype by name; any other
    type raises TypeError."""
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (set, frozenset)):
        items = [plain(v) for v in value]
        if all(isinstance(v, str) for v in items):  # target_modules and the like
            return sorted(cast("list[str]", items))
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"{type(value).__name__} value {value!r} is not JSON data")


def adapter_config(pm: PeftLike, name: str) -> dict[str, object]:
    """adapter ``name``'s adapter_config.json as ``PeftModel.save_pretrained`` writes it:
    ``config.to_dict()``, sets as (sorted) lists, ``inference_mode`` true,
    ``base_model_name_or_path`` from the base model when unset, ``auto_mapping`` when the
    config has no ``task_type``."""
    cfg = pm.peft_config[name]
    d: dict[str, object] = dict(cfg.to_dict())
    d["inference_mode"] = True
    prompt = bool(getattr(cfg, "is_prompt_learning", False))
    if d.get("base_model_name_or_path") is None:
        holder = pm.base_model if prompt else getattr(pm.base_model, "model", pm.base_model)
        d["base_model_name_or_path"] = holder.__dict__.get("name_or_path", None) or None
    if d.get("task_type") is None:
        cls = type(pm.base_model if prompt else getattr(pm.base_model, "model", pm.base_model))
        d["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return cast("dict[str, object]", plain(d))


def _base(pm: PeftLike) -> dict[str, object]:
    base = pm.get_base_model()
    if not isinstance(base, torch.nn.Module):
        return {"error": "the PEFT model has no base model (get_base_model())"}
    cls = type(base)
    out: dict[str, object] = {"class": cls.__name__, "module": cls.__module__}
    config = getattr(base, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if config is None or not callable(to_json):
        out["error"] = (f"the base model {cls.__name__} has no transformers config "
                        "(config.to_json_string)")
        return out
    out["config_class"] = type(config).__name__
    out["config"] = json.loads(to_json(use_diff=False))
    return out


def _embedding_targeted(pm: PeftLike, cfg: object) -> bool:
    """PEFT's ``save_embedding_layers="auto"`` without its Hub look-up: True when the
    config targets an embedding layer (and trains no token subset), as
    ``get_peft_model_state_dict`` decides it; the resized-vocabulary case (which PEFT
    detects by reading the base model's config from the Hub) is not detected."""
    try:
        from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND
        from peft.utils.other import EMBEDDING_LAYER_NAMES, match_target_against_key
    except ImportError:  # another PEFT: only the plain list form is checked
        tm = getattr(cfg, "target_modules", None) or ()
        return not isinstance(tm, str) and any(
            k in tm for k in ("embed_tokens", "lm_head", "wte", "word_embeddings"))
    if getattr(cfg, "peft_type", None) == "TRAINABLE_TOKENS" or getattr(
            cfg, "trainable_token_indices", None) is not None:
        return False
    tm = getattr(cfg, "target_modules", None) or ()
    if isinstance(tm, str) and tm != INCLUDE_LINEAR_LAYERS_SHORTHAND:
        base = pm.get_base_model()
        return any(match_target_against_key(tm, k) for k, _ in base.named_modules()
                   if any(re.match(rf"(.*\.)?{e}$", k) for e in EMBEDDING_LAYER_NAMES))
    return not isinstance(tm, str) and any(k in tm for k in EMBEDDING_LAYER_NAMES)


def _tensor_names(pm: PeftLike, state: dict[str, torch.Tensor], name_of: dict[int, str]
                  ) -> _Names:
    """{adapter: ({saved key: snapshot name}, error or None)} from PEFT's own
    ``get_peft_model_state_dict`` over the live tensors."""
    from peft import get_peft_model_state_dict

    out: _Names = {}
    for name, cfg in pm.peft_config.items():
        if getattr(cfg, "is_prompt_learning", False):
            out[name] = ({}, f"{plain(cfg.peft_type)} is a prompt-learning method: its saved "
                         "tensors are computed by the prompt encoder, not stored parameters")
            continue
        saved = get_peft_model_state_dict(pm, state_dict=state, adapter_name=name,
                                          save_embedding_layers=_embedding_targeted(pm, cfg))
        tensors: dict[str, str] = {}
        bad = []
        for key, t in saved.items():
            if isinstance(t, torch.Tensor) and id(t) in name_of:
                tensors[key] = name_of[id(t)]
            else:
                bad.append(key)
        out[name] = (tensors, None if not bad else
                     f"PEFT saves {len(bad)} value(s) that are not parameters or buffers of "
                     f"the model (first: {bad[0]!r})")
    return out


def _record(mkey: str, mod: torch.nn.Module, path: str, pm_mod: torch.nn.Module
            ) -> dict[str, object]:
    pm = cast("PeftLike", pm_mod)
    live = module_state.live(pm_mod)
    outer = live if mod is pm_mod else module_state.live(mod)
    name_of: dict[int, str] = {}
    all_names: set[str] = set()
    for n, t, _ in outer:
        full = f"{mkey}.{n}"
        name_of.setdefault(id(t), full)
        all_names.add(full)
    prefix = f"{mkey}.{path}"
    renamed = {k: name_of[id(t)] for k, t, _ in live
               if prefix + k not in all_names and id(t) in name_of}
    active = getattr(pm, "active_adapters", None)
    active_list = [active] if isinstance(active, str) else list(active or [])
    fingerprint = (tuple((n, id(c)) for n, c in pm.peft_config.items()), tuple(active_list),
                   tuple(id(t) for _, t, _ in live), mkey, path)
    cached = _CACHE.get(pm_mod)
    if cached is not None and cached[0] == fingerprint:
        names = cached[1]
    else:
        state = {k: t for k, t, _ in live}
        names = _tensor_names(pm, state, name_of)
        _CACHE[pm_mod] = (fingerprint, names)
    adapters: dict[str, object] = {}
    for name, cfg in pm.peft_config.items():
        tensors, error = names[name]
        rec: dict[str, object] = {"peft_type": plain(cfg.peft_type),
                                  "config": adapter_config(pm, name), "tensors": dict(tensors)}
        if error:
            rec["error"] = error
        adapters[str(name)] = rec
    out: dict[str, object] = {"version": RECORD_VERSION, "prefix": prefix, "renamed": renamed,
                              "active": [str(a) for a in active_list], "adapters": adapters,
                              "base": _base(pm)}
    json.dumps(out, allow_nan=False)  # plain JSON or an error record (describe catches it)
    return out
