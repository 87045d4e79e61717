"""``cudasnap export --to dcp`` and its reader: a torch.distributed.checkpoint checkpoint of
a snapshot that any mesh or world size loads.

Owns: :func:`export_dcp` (written by DCP's own FileSystemWriter, with the host sidecar
:data:`HOST_SIDECAR`, renamed into place whole). Its reader, ``load_resharded``
(``cudasnap.load_resharded``: DCP's resharding load, then the optimizer's param groups),
is ``cudasnap.core.dcp_load``, below the facade that names it.

Call order: ``cudasnap export --to dcp`` (cudasnap.tools.cli) -> :func:`export_dcp` ->
cudasnap.tools.shards (``gather``: ``load_shards`` -> ``optim_merge`` -> ``_chunks``) -> cudasnap.tools.dcp_keys
(``plan``: the keys) -> FileSystemWriter. A training script, on every rank:
:func:`load_resharded`. Both are also importable from cudasnap.tools.export.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .._native import native
from ..core.dcp_load import HOST_SIDECAR
from ..errors import ConfigError
from ..format import codec
from ..format.manifest import torch_dtype
from . import dcp_views
from .shards import _assemble, gather

log = logging.getLogger("cudasnap.export")




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
    from torch.distributed.checkpoint.planner import SavePlan

    from . import dcp_keys

    out_dir = Path(out_dir)
    _check_target(Path(directory), out_dir)
    g = gather(directory, step)  # pipeline stages merged by FQN, strided shards as boxes
    step_, chunks, m0, host = g.step, g.chunks, g.manifest, g.host
    _warn_hooked(m0)
    keys = dcp_keys.plan(chunks, m0, host, step_, g.other_hosts)
    order = sorted({r["rank"] for r in g.ranks})
    items, data, md, aliases = _Plan(order).build(chunks, keys, m0)
    side = {"step": step_, "world_size": m0.get("world_size", 1),
            "keys": "fqn" if keys.fqn_keys else "index",
            "optim": {k: {"param_groups": v.get("param_groups"), "class": v.get("class")}
                      for k, v in host.get("optim", {}).items()}}
    _write(out_dir, [SavePlan(items[r]) for r in order], data, aliases, md, side)
    log.info("exported step %d to %s (%d keys)", step_, out_dir, len(md))
    return out_dir


def _check_target(directory: Path, out_dir: Path) -> None:
    """ConfigError unless ``out_dir`` is absent or empty, outside the snapshot directory,
    and its parent exists."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"export target {out_dir} exists and is not an empty directory")
    d = directory.resolve()
    if out_dir.resolve() == d or d in out_dir.resolve().parents:
        raise ConfigError(f"export target {out_dir} is inside the snapshot directory {directory}; "
                          "write it elsewhere")
    if not out_dir.parent.is_dir():
        raise ConfigError(f"export target {out_dir}: its parent directory {out_dir.parent} "
                          "does not exist")


def _warn_hooked(m0: dict[str, Any]) -> None:
    """A WARNING when state_dict hooks build some module's keys from its parameters."""
    hooked = (m0.get("dcp_names") or {}).get("hooked") or {}
    if isinstance(hooked, dict) and hooked:
        mods = [f"{k}.{p}" if p else k for k, ps in hooked.items() for p in ps]
        log.warning(
            "export --to dcp: the state_dict of %s is built by hooks from the parameters (e.g. "
            "torchtitan's fused wqkv split into wq/wk/wv); the export holds the parameters under "
            "their own names, which a loader asking for the hook's keys will not find (it fails "
            "naming a missing key). To continue in such a framework: restore the snapshot into "
            "the model (restore_latest) and save with the framework's own checkpoint",
            ", ".join(mods[:4]) + (", ..." if len(mods) > 4 else ""))


def _write(out_dir: Path, local_plans: list[Any], data: dict[Any, Any],
           aliases: dict[Any, list[Any]], md: dict[str, Any], side: dict[str, Any]) -> None:
    """DCP's FileSystemWriter writes the plans (one per rank) into a temporary directory
    beside ``out_dir``, with every alias of a stored value pointing at its bytes, the
    metadata and the host sidecar; files 0600 and fsynced, then renamed into place."""
    import shutil

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult

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
        plans = writer.prepare_global_plan([writer.prepare_local_plan(p) for p in local_plans])
        results = [writer.write_data(p, _Source()).wait() for p in plans]  # type: ignore[arg-type]
        for res in results:  # every other name of a stored value points at its bytes
            res.extend(WriteResult(index=a, size_in_bytes=wr.size_in_bytes,
                                   storage_data=wr.storage_data)
                       for wr in list(res) for a in aliases.get(wr.index, ()))
        writer.finish(Metadata(state_dict_metadata=md), results)
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


class _Plan:
    """What DCP's writer is handed, per rank: write items, the bytes of each, the metadata of
    every key, and the other names (aliases) of each stored value (``build``)."""

    def __init__(self, order: list[int]) -> None:
        self.order = order
        self.items: dict[int, list[Any]] = {r: [] for r in order}
        self.data: dict[Any, Any] = {}
        self.md: dict[str, Any] = {}
        self.aliases: dict[Any, list[Any]] = {}

    def add_tensor(self, fqns: list[str], shape: Any, dtype: Any,
                   parts: list[tuple[Any, int, Any]]) -> None:
        """``parts``: (offset, rank, local tensor); written under fqns[0], the rest alias it."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties(dtype=dtype)
        cks = []
        for off, rank, t in parts:
            idx = MetadataIndex(fqns[0], torch.Size(off))
            ck = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(t.shape))
            cks.append(ck)
            self.items[rank].append(WriteItem(index=idx, type=WriteItemType.SHARD,
                                              tensor_data=TensorWriteData(
                                                  chunk=ck, properties=props,
                                                  size=torch.Size(shape))))
            self.data[idx] = t.contiguous()
            self.aliases[idx] = [MetadataIndex(f, torch.Size(off)) for f in fqns[1:]]
        for f in fqns:
            self.md[f] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=cks)

    def add_object(self, k: str, v: Any) -> None:
        """A value under key ``k``: a tensor as one chunk; anything else torch.save'd (DCP's
        own rule for a non-tensor value, DefaultSavePlanner)."""
        import io

        import torch
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        if isinstance(v, torch.Tensor):
            self.add_tensor([k], list(v.shape), v.dtype, [((0,) * v.dim(), self.order[0], v)])
            return
        idx = MetadataIndex(k)
        buf = io.BytesIO()
        torch.save(v, buf)
        buf.seek(0)
        self.data[idx] = buf
        self.items[self.order[0]].append(WriteItem(index=idx, type=WriteItemType.BYTE_IO))
        self.md[k] = BytesStorageMetadata()

    def build(self, chunks: dict[str, Any], keys: Any, m0: dict[str, Any]
              ) -> tuple[dict[int, list[Any]], dict[Any, Any], dict[str, Any], dict[Any, list[Any]]]:
        """Every tensor under its keys, the objects, the views a hook derives (e.g. a fused
        weight split), and the keys that name another's value."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for name, ent in chunks.items():
            if keys.tensors.get(name):
                self.add_tensor(keys.tensors[name], ent["shape"], torch_dtype(ent["dtype"]),
                                [(off, rank, t) for off, (rank, t) in ent["chunks"].items()])
        for k, v in keys.objects.items():
            self.add_object(k, v)
        views = (m0.get("dcp_names") or {}).get("views") or {}
        for name, spec in (views.items() if isinstance(views, dict) else ()):
            if name not in chunks or not isinstance(spec, dict):
                continue  # (a view of a tensor this snapshot lacks)
            full = _assemble(name, chunks[name])
            mkey = chunks[name]["group"].partition(":")[2]
            for key, part in zip(spec.get("names") or [], dcp_views.compute(full, spec, name)):
                # get_state_dict's name, and torchtitan's (model keys at the top level, a
                # pipeline stage's ``model.<i>.`` dropped too)
                top = key[len(mkey) + 1:] if key.startswith(f"{mkey}.") else key.partition(".")[2]
                forms = [k for k in (key, top if keys.fqn_keys else None)
                         if k and k not in self.md]
                if forms:
                    self.add_tensor(forms, list(part.shape), part.dtype,
                                    [((0,) * part.dim(), self.order[0], part)])
        for k, first in keys.same_as.items():
            self.aliases.setdefault(MetadataIndex(first), []).append(MetadataIndex(k))
            self.md[k] = self.md[first]
        return self.items, self.data, self.md, self.aliases
