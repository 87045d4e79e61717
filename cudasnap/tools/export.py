"""Export a cudasnap snapshot to formats a script's own resume path can load."""
from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._native import native
from ..errors import ConfigError, IncompatibleSnapshot, SnapshotError
from ..format import codec, paths
from ..format.manifest import Manifest, expand_params, torch_dtype
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
        o["param_groups"] = [expand_params(g) for g in h["param_groups"]]
        for idx, k, v in h.get("scalars", []):
            o["state"].setdefault(int(idx), {})[k] = v
    out = {"step": m["step"], "model": models.get("model", models),
           "optimizer": optims.get("optim", optims),
           "extra": {k: v.get("state") for k, v in host.get("extra", {}).items()},
           "cudasnap_manifest": json.loads(json.dumps({k: m[k] for k in ("step", "format_version")}))}
    return atomic_output(Path(to_file), lambda tmp: torch.save(out, tmp))


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
                                             "group": e["group"], "aliases": e.get("aliases", []),
                                             "param_index": e.get("param_index"),
                                             "state_key": e.get("state_key")})
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


HOST_SIDECAR = "cudasnap_host.json"


def export_dcp(directory: Path, out_dir: Path, step: int | None = None) -> Path:
    """A torch.distributed.checkpoint checkpoint of a (sharded) snapshot, written by DCP's
    own FileSystemWriter with per-chunk metadata, so ``dcp.load`` reshards it onto any mesh.

    Keys (``cudasnap.tools.dcp_keys``): what ``get_state_dict`` + ``dcp.load({"model": ...,
    "optim": ...})`` asks for (``model.<fqn>``, ``optim.state.<fqn>.<key>``,
    ``optim.param_groups.<i | fqn>.<key>``), what torchtitan's ``CheckpointManager`` asks for
    (``<fqn>``, ``optimizer.*``, ``train_state.step``, ``lr_scheduler.*``) and the index keys
    ``load_resharded`` reads; each tensor's bytes are stored once. The step, world size
    and param groups also go to ``cudasnap_host.json`` beside it. Written into a temporary
    directory beside ``out_dir`` and renamed into place: a kill mid-export leaves no
    ``out_dir`` (and an earlier export elsewhere untouched).
    """
    import io
    import shutil

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from . import dcp_keys

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"export target {out_dir} exists and is not an empty directory")
    d = Path(directory).resolve()
    if out_dir.resolve() == d or d in out_dir.resolve().parents:
        raise ConfigError(f"export target {out_dir} is inside the snapshot directory {directory}; "
                          "write it elsewhere")
    if not out_dir.parent.is_dir():
        raise ConfigError(f"export target {out_dir}: its parent directory {out_dir.parent} "
                          "does not exist")
    step_, ranks = load_shards(directory, step)
    chunks = _chunks(ranks)
    m0 = ranks[0]["manifest"]
    host = codec.decode(m0["host"], "host")
    keys = dcp_keys.plan(chunks, m0, host, step_)
    order = sorted({r["rank"] for r in ranks})
    items: dict[int, list[Any]] = {r: [] for r in order}
    data: dict[MetadataIndex, Any] = {}
    md: dict[str, Any] = {}
    aliases: dict[MetadataIndex, list[MetadataIndex]] = {}

    def add_tensor(fqns: list[str], shape: Any, dtype: Any, parts: list[tuple[Any, int, Any]]
                   ) -> None:
        """``parts``: (offset, rank, local tensor); written under fqns[0], the rest alias it."""
        props = TensorProperties(dtype=dtype)
        cks = []
        for off, rank, t in parts:
            idx = MetadataIndex(fqns[0], torch.Size(off))
            ck = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(t.shape))
            cks.append(ck)
            items[rank].append(WriteItem(index=idx, type=WriteItemType.SHARD,
                                         tensor_data=TensorWriteData(
                                             chunk=ck, properties=props, size=torch.Size(shape))))
            data[idx] = t.contiguous()
            aliases[idx] = [MetadataIndex(f, torch.Size(off)) for f in fqns[1:]]
        for f in fqns:
            md[f] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=cks)

    for name, ent in chunks.items():
        if keys.tensors.get(name):
            add_tensor(keys.tensors[name], ent["shape"], torch_dtype(ent["dtype"]),
                       [(off, rank, t) for off, (rank, t) in ent["chunks"].items()])
    for k, v in keys.objects.items():
        if isinstance(v, torch.Tensor):
            add_tensor([k], list(v.shape), v.dtype, [((0,) * v.dim(), order[0], v)])
            continue
        idx = MetadataIndex(k)
        buf = io.BytesIO()
        torch.save(v, buf)  # DCP's own rule for a non-tensor value (DefaultSavePlanner)
        buf.seek(0)
        data[idx] = buf
        items[order[0]].append(WriteItem(index=idx, type=WriteItemType.BYTE_IO))
        md[k] = BytesStorageMetadata()
    for k, first in keys.same_as.items():
        aliases.setdefault(MetadataIndex(first), []).append(MetadataIndex(k))
        md[k] = md[first]

    class _Source:  # what FileSystemWriter.write_data asks of a planner
        @staticmethod
        def resolve_data(item: Any) -> Any:
            return data[item.index]

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    try:
        writer = FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
        writer.reset(str(tmp))
        writer.set_up_storage_writer(True)
        plans = writer.prepare_global_plan(
            [writer.prepare_local_plan(SavePlan(items[r])) for r in order])
        results = [writer.write_data(p, _Source()).wait() for p in plans]  # type: ignore[arg-type]
        for res in results:  # every other name of a stored value points at its bytes
            res.extend(WriteResult(index=a, size_in_bytes=wr.size_in_bytes,
                                   storage_data=wr.storage_data)
                       for wr in list(res) for a in aliases.get(wr.index, ()))
        writer.finish(Metadata(state_dict_metadata=md), results)
        side = {"step": step_, "world_size": m0.get("world_size", 1),
                "keys": "fqn" if keys.fqn_keys else "index",
                "optim": {k: {"param_groups": v.get("param_groups"), "class": v.get("class")}
                          for k, v in host.get("optim", {}).items()}}
        (tmp / HOST_SIDECAR).write_text(codec.dumps(side, "export"))
        for f in tmp.iterdir():
            f.chmod(0o600)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked above)
        os.rename(tmp, out_dir)
        native().fsync_dir(str(out_dir.parent))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported step %d to %s (%d keys)", step_, out_dir, len(md))
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
