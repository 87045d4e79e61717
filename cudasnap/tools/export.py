"""Export a cudasnap snapshot to formats a script's own resume path can load.

Owns: the export targets' checks (:func:`check_export_target`, :func:`safetensors_paths`),
the atomic write of an output file (:func:`atomic_output`), ``--to torch``
(:func:`export_torch`) and ``--to safetensors`` (:func:`export_safetensors`). ``--to dcp``
and ``load_resharded`` live in cudasnap.tools.export_dcp, the offline reading of a snapshot
in cudasnap.tools.shards; both are importable from here too.

Call order: ``cudasnap export`` (cudasnap.tools.cli) -> a target check -> an export ->
cudasnap.tools.shards (the tensors) -> :func:`atomic_output` (the file, renamed into place).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._native import native
from ..core.dcp_load import HOST_SIDECAR, load_resharded
from ..errors import ConfigError, SnapshotError
from ..format import codec
from ..format.manifest import expand_params
from .dcp_keys import Titan
from .export_dcp import export_dcp
from .shards import _assemble, _step_dir, full_tensors, gather, load_shards, load_tensors
from .wrapped_entries import plain

__all__ = ["HOST_SIDECAR", "SAFETENSORS_MODEL", "SAFETENSORS_OPTIM", "atomic_output",
           "check_export_target", "export_dcp", "export_safetensors", "export_torch",
           "full_tensors", "load_resharded", "load_shards", "load_tensors", "safetensors_paths"]


def check_export_target(directory: Path, to_file: Path, need_parent: bool = True) -> None:
    """Refuses an export target inside the snapshot directory (``cudasnap export D --to torch
    D/latest`` overwrote the ``latest`` pointer, ``D/flush-log.jsonl`` the log), a directory,
    and a target whose parent directory does not exist."""
    d = Path(directory).resolve()
    t = Path(to_file).resolve()
    if t == d or d in t.parents:
        raise ConfigError(f"export target {to_file} is inside the snapshot directory "
                          f"{directory}; write it elsewhere")
    if t.is_dir():
        raise ConfigError(f"export target {to_file} is a directory; give a file name")
    if need_parent and not t.parent.is_dir():
        raise ConfigError(f"export target {to_file}: its directory {t.parent} does not exist")


def atomic_output(target: Path, write: Callable[[Path], None]) -> Path:
    """Runs ``write(tmp)`` on a temporary name beside ``target``, fsyncs it, makes it 0600
    and renames it over ``target``: a kill mid-export leaves the previous file whole (the
    exports used to write in place and tore it). Errors become ``SnapshotError`` naming the
    target; the temporary file is removed."""
    from .._proc import pid_alive

    target = Path(target)
    for old in target.parent.glob(f".{target.name}.tmp-*"):  # of a killed export
        pid = old.name.rpartition("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            old.unlink(missing_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.chmod(tmp, 0o600)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        native().fsync_dir(str(target.parent))
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, (SnapshotError, KeyboardInterrupt, SystemExit)):
            raise
        raise SnapshotError(f"export to {target} failed: {type(e).__name__}: {e}") from e
    return target


def export_torch(directory: Path, to_file: Path, step: int | None = None) -> Path:
    """Writes ``{"model": state_dict, "optimizer": {...}, "step": N, "extra": {...}}`` with torch.save.

    Model keys drop the ``model.`` prefix so ``model.load_state_dict(d["model"])``
    works; optimizer entries follow ``Optimizer.state_dict()`` (state keyed by
    parameter index, param_groups). The export is a torch (pickle) file by
    design: it is for the user's own loader; cudasnap's own format never pickles.

    A multi-rank snapshot (a committed step) is gathered offline: sharded tensors
    (FSDP2, tensor parallel) are assembled into full ones, replicas read once; host
    state is rank 0's, and ``"extra_by_rank"`` holds every rank's ``extra`` (per-rank
    state such as a dataloader's position).
    """
    import torch

    check_export_target(directory, to_file)
    g = gather(directory, step)
    chunks, ranks, m, host = g.chunks, g.ranks, g.manifest, g.host
    tensors = {name: _assemble(name, ent) for name, ent in chunks.items()}
    m_tensors = [{"name": name, **{k: ent[k] for k in ("group", "aliases", "param_index",
                                                        "state_key")}}
                 for name, ent in chunks.items()]
    models: dict[str, dict[str, Any]] = {}
    optims: dict[str, dict[str, Any]] = {}
    for e in m_tensors:
        group = e.get("group", "")
        kind, _, key = group.partition(":")
        if kind == "model":
            sd = models.setdefault(key, {})
            sd[e["name"][len(key) + 1:]] = tensors[e["name"]]
            for alias in e.get("aliases", []):
                sd[alias[len(key) + 1:]] = tensors[e["name"]]
        elif kind == "optim":
            st = optims.setdefault(key, {"state": {}, "param_groups": []})["state"]
            st.setdefault(e["param_index"], {})[e["state_key"]] = tensors[e["name"]]
    for key, h in host.get("optim", {}).items():
        o = optims.setdefault(key, {"state": {}, "param_groups": []})
        o["param_groups"] = [expand_params(g) for g in h["param_groups"]]
        for idx, k, v in h.get("scalars", []):
            o["state"].setdefault(int(idx), {})[k] = v
    out = {"step": m["step"], "model": models.get("model", _stages(models)),
           "optimizer": optims.get("optim", optims),
           "extra": {k: v.get("state") for k, v in host.get("extra", {}).items()},
           "cudasnap_manifest": json.loads(json.dumps({k: m[k] for k in ("step", "format_version")}))}
    if len(ranks) > 1 or int(m.get("world_size", 1)) > 1:
        out["extra_by_rank"] = {
            r["rank"]: {k: v.get("state") for k, v in
                        codec.decode(r["manifest"]["host"], "host").get("extra", {}).items()}
            for r in ranks}
    return atomic_output(Path(to_file), lambda tmp: torch.save(out, tmp))


def _stages(models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """torchtitan's pipeline stages (models ``model.<i>``, cudasnap.integrations.torchtitan)
    as one state_dict keyed by FQN, as torchtitan's ModelWrapper merges them; other sets of
    several models keyed by their names."""
    if not Titan.of(sorted(models), [], True) or len(models) < 2:
        return models
    merged: dict[str, Any] = {}
    for key in sorted(models, key=lambda k: int(k.rpartition(".")[2])):
        clash = sorted(set(merged) & set(models[key]))
        if clash:
            raise SnapshotError(f"pipeline stage {key!r} holds {clash[0]!r} as another stage "
                                "does; the stages cannot be merged into one state_dict")
        merged.update(models[key])
    return merged


SAFETENSORS_MODEL = "model.safetensors"  # the name from_pretrained(dir) reads
SAFETENSORS_OPTIM = "optimizer.safetensors"


def safetensors_paths(directory: Path, to: Path, optimizer: bool = False
                      ) -> tuple[Path, Path | None]:
    """(weights file, optimizer file or None) of ``export --to safetensors TO``.

    A ``TO`` ending in ``.safetensors`` is the weights file; anything else is a directory
    (created if needed) that gets ``model.safetensors``, as ``from_pretrained(TO)`` reads
    it. The optimizer file is ``optimizer.safetensors`` beside the weights."""
    to = Path(to)
    if to.suffix == ".safetensors" and not to.is_dir():
        model_file = to
        if not to.parent.is_dir() and not to.parent.parent.is_dir():  # one level is made
            raise ConfigError(f"export target {to}: its directory {to.parent.parent} "
                              "does not exist")
    else:
        if to.resolve() == Path(directory).resolve():
            raise ConfigError(f"export target {to} is the snapshot directory itself; "
                              "write it elsewhere")
        if to.exists() and not to.is_dir():
            raise ConfigError(f"export target {to} is a file; give a directory or a name "
                              "ending in .safetensors")
        if not to.is_dir() and not to.parent.is_dir():
            raise ConfigError(f"export target {to}: its directory {to.parent} does not exist")
        model_file = to / SAFETENSORS_MODEL
    optim_file = model_file.with_name(SAFETENSORS_OPTIM) if optimizer else None
    if optim_file is not None and optim_file.resolve() == model_file.resolve():
        raise ConfigError(f"export target {to}: the weights file would be the optimizer "
                          f"file {SAFETENSORS_OPTIM}; name it otherwise")
    for f in (model_file, optim_file):
        if f is not None:  # the export makes the file's directory (its parent exists)
            check_export_target(directory, f, need_parent=False)
    return model_file, optim_file


def _json_value(v: Any) -> Any:  # json.dumps default for param groups and scalar state
    tolist = getattr(v, "tolist", None)
    return tolist() if callable(tolist) else str(v)


def _refuse_peft(m0: dict[str, Any], directory: Path) -> None:
    """ConfigError for a snapshot of a PEFT model (its manifest's ``dcp_names["peft"]``):
    cudasnap.tools.export_peft writes what PEFT and from_pretrained load."""
    if ((m0.get("dcp_names") or {}).get("peft")):
        raise ConfigError(
            f"{directory}: a snapshot of a PEFT model: its wrapper's names (base_layer, "
            "lora_A.default) match no loader; use cudasnap.tools.export_peft.export_adapters "
            "(an adapter folder PeftModel.from_pretrained loads) or export_merged (base-model "
            "weights from_pretrained loads), or `cudasnap export --to safetensors [--merged]`")


def export_safetensors(directory: Path, to_file: Path, step: int | None = None,
                       optimizer: bool = False) -> Path:
    """Consolidated full tensors (shards of every rank gathered offline) as Hugging Face
    reads them; returns the weights file (see ``safetensors_paths`` for where it goes).

    The weights file holds the model's tensors only, under the model's own ``state_dict``
    keys (cudasnap's ``model.`` prefix stripped; kept as ``<key>.`` only when the snapshot
    holds several models). A tied weight (one tensor, several names: GPT-2's
    ``lm_head.weight`` and ``transformer.wte.weight``) is stored once, under its first
    ``state_dict`` name, the one ``save_pretrained`` keeps; ``from_pretrained`` re-ties the
    others. Metadata: ``format: pt``, ``cudasnap_step``, ``cudasnap_source`` (the snapshot's
    step directory), ``cudasnap_format_version``, ``cudasnap_dtypes`` (JSON list) and
    ``cudasnap_tied`` (JSON ``{dropped name: stored name}``: a strict ``load_state_dict``
    needs those keys put back).

    ``optimizer=True`` also writes ``optimizer.safetensors`` beside it: tensors
    ``state.<param index>.<key>`` (as ``Optimizer.state_dict()`` flattens them; prefixed
    ``<key>.`` when there are several optimizers) and metadata ``param_groups``,
    ``scalar_state`` (``[[index, key, value], ...]``) and ``optimizer_class`` as JSON
    (objects keyed by optimizer name when there are several). A tensor subclass's state
    (torchao's low-bit optimizer state) is written as its plain (dequantized) values.

    A snapshot of a PEFT model is refused (its wrapper's names match no loader):
    ``export_peft.export_adapters`` / ``export_merged`` write what PEFT and
    ``from_pretrained`` load (``cudasnap export --to safetensors [--merged]`` picks them)."""
    from safetensors.torch import save_file

    model_file, optim_file = safetensors_paths(directory, to_file, optimizer)
    snap = _step_dir(directory, step)
    g = gather(directory, snap.step)
    _refuse_peft(g.manifest, directory)
    step_, chunks, m0 = g.step, g.chunks, g.manifest

    def groups(kind: str) -> list[str]:
        return sorted({ent["group"].partition(":")[2] for ent in chunks.values()
                       if ent["group"].partition(":")[0] == kind})

    def key_of(name: str, group_key: str, strip: bool) -> str:
        return name[len(group_key) + 1:] if strip and name.startswith(group_key + ".") else name

    models = groups("model")
    one = len(models) == 1 or (len(models) > 1 and bool(Titan.of(models, [], True)))  # stages
    host = g.host.get("optim", {}) if optim_file is not None else {}
    optims = sorted(set(groups("optim")) | set(host))
    weights: dict[str, Any] = {}
    tied: dict[str, str] = {}
    moptim: dict[str, Any] = {}
    for name, ent in chunks.items():
        kind, _, gkey = ent["group"].partition(":")
        if kind == "model":
            k = key_of(name, gkey, one)
            weights[k] = plain(_assemble(name, ent))
            for a in ent["aliases"]:  # stored once: safetensors refuses shared storage
                tied[key_of(a, gkey, one)] = k
        elif kind == "optim" and optim_file is not None:
            moptim[key_of(name, gkey, len(optims) == 1)] = plain(_assemble(name, ent))
    common = {"format": "pt", "cudasnap_step": str(step_),
              "cudasnap_source": str(snap.path.resolve()),
              "cudasnap_format_version": str(m0.get("format_version", ""))}
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    model_file.parent.mkdir(mode=0o700, exist_ok=True)  # the parent exists (checked)
    atomic_output(model_file, lambda tmp: save_file(weights, str(tmp), metadata={
        **common, "cudasnap_dtypes": json.dumps(dtypes),
        "cudasnap_tied": json.dumps(tied, sort_keys=True)}))
    if optim_file is not None:
        info = {k: {"param_groups": [expand_params(g) for g in h.get("param_groups", [])],
                    "scalar_state": h.get("scalars", []), "optimizer_class": h.get("class")}
                for k, h in host.items()}
        meta = {f: json.dumps(next(iter(info.values()))[f] if len(optims) == 1 else
                              {k: v[f] for k, v in info.items()}, default=_json_value)
                for f in ("param_groups", "scalar_state", "optimizer_class")} if info else {}
        optim_meta = {**common, "cudasnap_dtypes": json.dumps(sorted(
            {str(t.dtype).removeprefix("torch.") for t in moptim.values()})), **meta}
        atomic_output(optim_file, lambda tmp: save_file(moptim, str(tmp), metadata=optim_meta))
    return model_file
