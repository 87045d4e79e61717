"""Export a cudasnap snapshot to formats a script's own resume path can load."""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from ..errors import ConfigError, IncompatibleSnapshot, SnapshotError
from ..format import codec, paths
from ..format.manifest import Manifest, torch_dtype
from ..storage import posix

log = logging.getLogger("cudasnap.export")


def load_tensors(directory: Path, step: int | None = None) -> tuple[dict[str, Any], Manifest]:
    """Returns ({tensor name: tensor}, manifest) of a verified snapshot."""
    snaps = posix.list_snapshots(Path(directory))
    if step is not None:
        snaps = [s for s in snaps if s.step == step]
    if not snaps:
        raise SnapshotError(f"no snapshot{f' of step {step}' if step is not None else ''} "
                            f"in {directory}")
    s = snaps[0]
    m = posix.load_manifest(s.manifest_path)
    data = posix.read_data(s.path, m)
    out = {}
    for e in m["tensors"]:
        dt = torch_dtype(e["dtype"])
        n = e["nbytes"]
        t = data[e["offset"]:e["offset"] + n].view(dt).as_strided(e["shape"], e["stride"]) \
            if n else data[:0].view(dt).reshape(e["shape"])
        out[e["name"]] = t.clone()
    return out, m


def check_export_target(directory: Path, to_file: Path) -> None:
    """Refuses an export target that is one of the snapshot directory's own files.

    (``cudasnap export D --to torch D/latest`` overwrote the ``latest`` pointer.)
    """
    d = Path(directory).resolve()
    t = Path(to_file).resolve()
    if t == d or t.is_dir():
        raise ConfigError(f"export target {to_file} is a directory; give a file name")
    if t.parent == d and (t.name == paths.LATEST or t.name.startswith(".")
                          or t.name.startswith("step-")) or d in t.parents and any(
            p.name.startswith("step-") for p in t.relative_to(d).parents if p != Path(".")):
        raise ConfigError(f"export target {to_file} is inside the snapshot directory's own "
                          f"files (it would overwrite {t.relative_to(d)}); write it elsewhere")


def export_torch(directory: Path, to_file: Path, step: int | None = None) -> Path:
    """Writes ``{"model": state_dict, "optimizer": {...}, "step": N, "extra": {...}}`` with torch.save.

    Model keys drop the ``model.`` prefix so ``model.load_state_dict(d["model"])``
    works; optimizer entries follow ``Optimizer.state_dict()`` (state keyed by
    parameter index, param_groups). The export is a torch (pickle) file by
    design: it is for the user's own loader; cudasnap's own format never pickles.
    """
    import torch

    check_export_target(directory, to_file)
    tensors, m = load_tensors(directory, step)
    host = codec.decode(m["host"], "host")
    models: dict[str, dict[str, Any]] = {}
    optims: dict[str, dict[str, Any]] = {}
    for e in m["tensors"]:
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
        from ..core.state import _expand_params

        o["param_groups"] = [_expand_params(g) for g in h["param_groups"]]
        for idx, k, v in h.get("scalars", []):
            o["state"].setdefault(int(idx), {})[k] = v
    out = {"step": m["step"], "model": models.get("model", models),
           "optimizer": optims.get("optim", optims),
           "extra": {k: v.get("state") for k, v in host.get("extra", {}).items()},
           "cudasnap_manifest": json.loads(json.dumps({k: m[k] for k in ("step", "format_version")}))}
    to_file = Path(to_file)
    torch.save(out, to_file)
    return to_file


# ------------------------------------------------------------ sharded (multi-rank) snapshots
def _step_dir(directory: Path, step: int | None) -> posix.StoredSnapshot:
    snaps = posix.list_snapshots(Path(directory))
    if step is not None:
        snaps = [s for s in snaps if s.step == step]
    # A multi-rank step counts only with its COMMIT marker (every rank's files durable).
    snaps = [s for s in snaps if (s.path / paths.MANIFEST).is_file() or posix.is_committed(s.path)]
    if not snaps:
        raise SnapshotError(f"no committed snapshot{f' of step {step}' if step is not None else ''}"
                            f" in {directory}")
    return snaps[0]


def load_shards(directory: Path, step: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(step, one record per rank: {"rank", "manifest", "tensors": {name: local tensor}}) of
    the newest committed snapshot, every rank's files verified. Offline: no process group."""
    s = _step_dir(directory, step)
    if (s.path / paths.MANIFEST).is_file():
        rank_dirs = [s.path]
    else:
        commit = posix.read_commit(s.path)
        missing = [r for r in range(int(commit["world_size"]))
                   if not (s.path / paths.rank_dirname(r) / paths.MANIFEST).is_file()]
        if missing:  # replicated ranks may be absent; the assembly checks coverage
            log.info("%s: no files of rank(s) %s", s.path, missing)
        rank_dirs = [s.path / paths.rank_dirname(r) for r in range(int(commit["world_size"]))
                     if r not in missing]
    out = []
    for d in rank_dirs:
        m = posix.load_manifest(d / paths.MANIFEST)
        tensors, _ = _views(posix.read_data(d, m), m)
        out.append({"rank": int(m.get("rank", 0)), "manifest": m, "tensors": tensors})
    return s.step, out


def _views(data: Any, m: Manifest) -> tuple[dict[str, Any], None]:
    out = {}
    for e in m["tensors"]:
        dt = torch_dtype(e["dtype"])
        n = e["nbytes"]
        out[e["name"]] = data[e["offset"]:e["offset"] + n].view(dt).as_strided(
            e["shape"], e["stride"]) if n else data[:0].view(dt).reshape(e["shape"])
    return out, None


def _chunks(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tensor name: dtype, global shape, and its distinct chunks {offset tuple: (rank,
    local tensor)} (a replicated chunk once, from the lowest rank holding it)."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted(ranks, key=lambda x: x["rank"]):
        for e in r["manifest"]["tensors"]:
            sh = e.get("shard")
            if sh is not None:
                bad = [p for p in sh["placements"] if not (p.startswith("Shard(") or
                                                          p == "Replicate()")]
                if bad:
                    raise ConfigError(f"{e['name']}: placement {bad[0]} cannot be exported "
                                      "offline (only Shard(d) and Replicate())")
                gshape, off = sh["global_shape"], tuple(sh["offset"])
            else:
                gshape, off = e["shape"], tuple(0 for _ in e["shape"])
            ent = out.setdefault(e["name"], {"dtype": e["dtype"], "shape": gshape, "chunks": {},
                                             "group": e["group"], "aliases": e.get("aliases", [])})
            if ent["shape"] != gshape or ent["dtype"] != e["dtype"]:
                raise SnapshotError(f"{e['name']}: ranks disagree on its global shape or dtype")
            ent["chunks"].setdefault(off, (r["rank"], r["tensors"][e["name"]]))
    return out


def _assemble(name: str, ent: dict[str, Any]) -> Any:
    """The full tensor of one ``_chunks`` entry (its chunks laid into place)."""
    import torch

    full = torch.zeros(ent["shape"], dtype=torch_dtype(ent["dtype"]))
    covered = 0
    for off, (_, t) in ent["chunks"].items():
        full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
        covered += t.numel()
    if covered != full.numel():
        raise SnapshotError(f"{name}: the ranks' shards cover {covered} of {full.numel()} "
                            "elements (files of a rank missing?)")
    return full


def full_tensors(directory: Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """(step, {name: full tensor}) assembled offline from every rank's local shards."""
    step_, ranks = load_shards(directory, step)
    out = {}
    for name, ent in _chunks(ranks).items():
        full = _assemble(name, ent)
        out[name] = full
        for a in ent["aliases"]:
            out[a] = full.clone()
    return step_, out


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
    else:
        if to.resolve() == Path(directory).resolve():
            raise ConfigError(f"export target {to} is the snapshot directory itself; "
                              "write it elsewhere")
        model_file = to / SAFETENSORS_MODEL
    optim_file = model_file.with_name(SAFETENSORS_OPTIM) if optimizer else None
    if optim_file is not None and optim_file.resolve() == model_file.resolve():
        raise ConfigError(f"export target {to}: the weights file would be the optimizer "
                          f"file {SAFETENSORS_OPTIM}; name it otherwise")
    for f in (model_file, optim_file):
        if f is not None:
            check_export_target(directory, f)
    return model_file, optim_file


def _json_value(v: Any) -> Any:  # json.dumps default for param groups and scalar state
    tolist = getattr(v, "tolist", None)
    return tolist() if callable(tolist) else str(v)


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
    (objects keyed by optimizer name when there are several)."""
    from safetensors.torch import save_file

    from ..core.state import _expand_params

    model_file, optim_file = safetensors_paths(directory, to_file, optimizer)
    snap = _step_dir(directory, step)
    step_, ranks = load_shards(directory, snap.step)
    chunks = _chunks(ranks)
    m0 = ranks[0]["manifest"]

    def groups(kind: str) -> list[str]:
        return sorted({ent["group"].partition(":")[2] for ent in chunks.values()
                       if ent["group"].partition(":")[0] == kind})

    def key_of(name: str, group_key: str, strip: bool) -> str:
        return name[len(group_key) + 1:] if strip and name.startswith(group_key + ".") else name

    models = groups("model")
    host = codec.decode(m0["host"], "host").get("optim", {}) if optim_file is not None else {}
    optims = sorted(set(groups("optim")) | set(host))
    weights: dict[str, Any] = {}
    tied: dict[str, str] = {}
    moptim: dict[str, Any] = {}
    for name, ent in chunks.items():
        kind, _, gkey = ent["group"].partition(":")
        if kind == "model":
            k = key_of(name, gkey, len(models) == 1)
            weights[k] = _assemble(name, ent)
            for a in ent["aliases"]:  # stored once: safetensors refuses shared storage
                tied[key_of(a, gkey, len(models) == 1)] = k
        elif kind == "optim" and optim_file is not None:
            moptim[key_of(name, gkey, len(optims) == 1)] = _assemble(name, ent)
    common = {"format": "pt", "cudasnap_step": str(step_),
              "cudasnap_source": str(snap.path.resolve()),
              "cudasnap_format_version": str(m0.get("format_version", ""))}
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    model_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(model_file), metadata={
        **common, "cudasnap_dtypes": json.dumps(dtypes),
        "cudasnap_tied": json.dumps(tied, sort_keys=True)})
    if optim_file is not None:
        info = {k: {"param_groups": [_expand_params(g) for g in h.get("param_groups", [])],
                    "scalar_state": h.get("scalars", []), "optimizer_class": h.get("class")}
                for k, h in host.items()}
        meta = {f: json.dumps(next(iter(info.values()))[f] if len(optims) == 1 else
                              {k: v[f] for k, v in info.items()}, default=_json_value)
                for f in ("param_groups", "scalar_state", "optimizer_class")} if info else {}
        save_file(moptim, str(optim_file), metadata={
            **common, "cudasnap_dtypes": json.dumps(sorted(
                {str(t.dtype).removeprefix("torch.") for t in moptim.values()})), **meta})
    return model_file


HOST_SIDECAR = "cudasnap_host.json"


def export_dcp(directory: Path, out_dir: Path, step: int | None = None) -> Path:
    """A torch.distributed.checkpoint checkpoint of a (sharded) snapshot, written by DCP's
    own FileSystemWriter with per-chunk metadata, so ``dcp.load`` reshards it onto any mesh.

    Keys: ``model.<state_dict key>`` (as ``dcp.load({"model": model.state_dict()}, ...)``
    flattens them) and ``optim.state.<param index>.<key>``; the optimizer's param groups
    and the step go to ``cudasnap_host.json`` beside it (read by ``load_resharded``).
    """
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"export target {out_dir} exists and is not empty")
    step_, ranks = load_shards(directory, step)
    chunks = _chunks(ranks)
    order = sorted({r["rank"] for r in ranks})
    items: dict[int, list[Any]] = {r: [] for r in order}
    data: dict[MetadataIndex, Any] = {}
    md: dict[str, Any] = {}
    for name, ent in chunks.items():
        names = [name, *ent["aliases"]]
        props = TensorProperties(dtype=torch_dtype(ent["dtype"]))
        for fqn in names:
            cks = []
            for off, (rank, t) in ent["chunks"].items():
                idx = MetadataIndex(fqn, torch.Size(off))
                ck = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(t.shape))
                cks.append(ck)
                items[rank].append(WriteItem(index=idx, type=WriteItemType.SHARD,
                                             tensor_data=TensorWriteData(
                                                 chunk=ck, properties=props,
                                                 size=torch.Size(ent["shape"]))))
                data[idx] = t.contiguous()
            md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(ent["shape"]),
                                            chunks=cks)

    class _Source:  # what FileSystemWriter.write_data asks of a planner
        @staticmethod
        def resolve_data(item: Any) -> Any:
            return data[item.index]

    writer = FileSystemWriter(str(out_dir), single_file_per_rank=True, sync_files=True)
    writer.reset(str(out_dir))
    writer.set_up_storage_writer(True)
    plans = writer.prepare_global_plan(
        [writer.prepare_local_plan(SavePlan(items[r])) for r in order])
    results = [writer.write_data(p, _Source()).wait() for p in plans]  # type: ignore[arg-type]
    writer.finish(Metadata(state_dict_metadata=md), results)
    m0 = ranks[0]["manifest"]
    host = codec.decode(m0["host"], "host")
    side = {"step": step_, "world_size": m0.get("world_size", 1),
            "optim": {k: {"param_groups": v.get("param_groups"), "class": v.get("class")}
                      for k, v in host.get("optim", {}).items()}}
    (out_dir / HOST_SIDECAR).write_text(codec.dumps(side, "export"))
    return out_dir


def load_resharded(checkpoint: str | Path, model: Any, optimizer: Any = None) -> int:
    """Loads a ``cudasnap export --to dcp`` checkpoint into ``model`` (and ``optimizer``) on
    any mesh or world size (DCP reshards: call it on every rank); returns the step to
    resume at. RNG and ``extra`` state are per rank and not carried over."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    checkpoint = Path(checkpoint)
    side = codec.loads((checkpoint / HOST_SIDECAR).read_text(), str(checkpoint / HOST_SIDECAR))
    sd: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    params: list[Any] = []
    if optimizer is not None:
        _init_optim_state(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    sd[f"optim.state.{i}.{k}"] = v
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=str(checkpoint), no_dist=no_dist)
    if optimizer is not None:
        saved = (side.get("optim") or {}).get("optim") or next(iter(side.get("optim", {}).values()),
                                                                None)
        if saved and saved.get("param_groups"):
            if len(saved["param_groups"]) != len(optimizer.param_groups):
                raise IncompatibleSnapshot(
                    f"{checkpoint}: {len(saved['param_groups'])} param groups saved, the "
                    f"optimizer has {len(optimizer.param_groups)}")
            for g, s in zip(optimizer.param_groups, saved["param_groups"]):
                g.update({k: v for k, v in s.items() if k != "params"})
    return int(side["step"]) + 1
