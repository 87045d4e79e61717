"""Reading a snapshot offline, for the exports: no process group, every file verified.

Owns: one single-rank snapshot's tensors (:func:`load_tensors`); a (multi-rank) step's
per-rank local tensors (:func:`load_shards`, only a committed step); the distinct chunks
of each tensor across ranks (:func:`_chunks`) and a full tensor laid out from them
(:func:`_assemble`, :func:`full_tensors`).

Call order: cudasnap.tools.export (``export_torch`` and
``export_safetensors``: ``_step_dir`` -> ``load_shards`` -> ``_chunks`` -> ``_assemble``) and
cudasnap.tools.export_dcp (``load_shards`` -> ``_chunks``, then cudasnap.tools.dcp_keys).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SnapshotError
from ..format import paths
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
