"""Reading a snapshot offline, for the exports: no process group, every file verified.

Owns: one single-rank snapshot's tensors (:func:`load_tensors`); a (multi-rank) step's
per-rank local tensors (:func:`load_shards`, only a committed step; a tensor subclass's inner
tensors folded into its value: cudasnap.tools.wrapped_entries); where a local shard lies
in its global tensor (:func:`local_indices`: the ``shard`` record's placements, ``Shard``,
``_StridedShard`` and ``Replicate``, applied left to right as DTensor does, uneven sizes
included) and its rectangular pieces (:func:`boxes`); pipeline stages' optimizers merged by
parameter FQN (:func:`optim_merge`); the distinct chunks of each tensor across ranks, checked
to cover it once (:func:`_chunks`); a full tensor laid out from them (:func:`_assemble`,
:func:`full_tensors`); all of it for an export (:func:`gather`).

Call order: cudasnap.tools.export (``export_torch`` and ``export_safetensors``) and
cudasnap.tools.export_dcp: ``gather`` -> ``load_shards`` -> ``optim_merge`` -> ``_chunks``
(-> ``boxes`` -> ``local_indices``) -> ``_assemble`` (torch, safetensors) or dcp_keys (dcp).
"""
from __future__ import annotations

import itertools
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..errors import ConfigError, SnapshotError
from ..format import codec, paths
from ..format.manifest import Manifest, expand_params, torch_dtype
from ..storage import listing, posix
from . import wrapped_entries

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
    snaps = [s for s in snaps if (s.path / paths.MANIFEST).is_file() or listing.is_committed(s.path)]
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
        commit = listing.read_commit(s.path)
        missing = [r for r in range(int(commit["world_size"]))
                   if not (s.path / paths.rank_dirname(r) / paths.MANIFEST).is_file()]
        if missing:  # replicated ranks may be absent; the assembly checks coverage
            log.info("%s: no files of rank(s) %s", s.path, missing)
        rank_dirs = [s.path / paths.rank_dirname(r) for r in range(int(commit["world_size"]))
                     if r not in missing]
    out = []
    for d in rank_dirs:
        m = posix.load_manifest(d / paths.MANIFEST)
        fm, tensors = wrapped_entries.fold(cast("dict[str, Any]", m),  # subclass values
                                           _views(posix.read_data(d, m), m)[0])
        out.append({"rank": int(fm.get("rank", 0)), "manifest": fm, "tensors": tensors})
    return s.step, out


def _views(data: Any, m: Manifest) -> tuple[dict[str, Any], None]:
    out = {}
    for e in m["tensors"]:
        dt = torch_dtype(e["dtype"])
        n = e["nbytes"]
        out[e["name"]] = data[e["offset"]:e["offset"] + n].view(dt).as_strided(
            e["shape"], e["stride"]) if n else data[:0].view(dt).reshape(e["shape"])
    return out, None


_SHARD_RE = re.compile(r"^Shard\((?:dim=)?(\d+)\)$")
_STRIDED_RE = re.compile(r"^_StridedShard\(dim=(\d+), (?:sf|split_factor)=(\d+)\)$")


def _placement(p: str, name: str) -> tuple[int | None, int]:
    """(tensor dim, split factor) of a placement's text; (None, 1) for ``Replicate()``.
    ConfigError naming the tensor for a placement whose local value is no slice of the
    global tensor (``Partial``) or one this cudasnap does not know."""
    if p == "Replicate()":
        return None, 1
    m = _SHARD_RE.match(p) or _STRIDED_RE.match(p)
    if m:
        return int(m.group(1)), int(m.group(2)) if m.re is _STRIDED_RE else 1
    why = ("a Partial placement holds a per-rank partial value still to be reduced across "
           "ranks, not a slice of the global tensor" if p.startswith("Partial(") else
           "a placement this cudasnap does not know")
    raise ConfigError(f"{name}: placement {p} cannot be exported offline: {why} (Shard(d), "
                      "_StridedShard(dim=d, sf=k) and Replicate() are assembled)")


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """[start, stop) of chunk ``i`` of ``torch.chunk`` of ``n`` items into ``k`` (the chunks
    past the last one empty, as DTensor's ``Shard`` fills them)."""
    size = -(-n // k) if n else 0
    return min(i * size, n), min((i + 1) * size, n)


Runs = list[tuple[int, int]]  # (global start, length) of consecutive global indices


def _take(runs: Runs, a: int, b: int) -> Runs:
    """Positions [a, b) of the index sequence ``runs`` spells, as runs."""
    out: Runs = []
    pos = 0
    for g, n in runs:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            if out and out[-1][0] + out[-1][1] == g + lo - pos:
                out[-1] = (out[-1][0], out[-1][1] + hi - lo)
            else:
                out.append((g + lo - pos, hi - lo))
        pos += n
    return out


def _split(runs: Runs, k: int, i: int, sf: int) -> Runs:
    """Piece ``i`` of ``k`` of an index sequence, as ``Shard`` (sf 1) or ``_StridedShard``
    (``split_factor`` sf) ``_split_tensor`` cuts it: chunked into ``sf`` pieces, each of
    them into ``k``, piece ``i`` of each concatenated."""
    n = sum(m for _, m in runs)
    out: Runs = []
    for a, b in (_chunk(n, sf, j) for j in range(sf)):
        c, d = _chunk(b - a, k, i)
        for g, m in _take(runs, a + c, a + d):
            if out and out[-1][0] + out[-1][1] == g:
                out[-1] = (out[-1][0], out[-1][1] + m)
            else:
                out.append((g, m))
    return out


def local_indices(name: str, shard: dict[str, Any], local_shape: list[int]) -> list[Runs]:
    """Per tensor dimension, the global indices a rank's local shard holds, in local order
    (as runs): the placements applied left to right to each dimension's index range, as
    DTensor lays a tensor out (``distribute_tensor``, ``full_tensor``). SnapshotError naming
    the tensor unless that gives the shard's own shape."""
    gshape = [int(n) for n in shard["global_shape"]]
    mesh, coord = shard.get("mesh_shape"), shard.get("coord")
    placements = list(shard["placements"])
    if coord is None or mesh is None or not len(coord) == len(placements) == len(mesh):
        raise SnapshotError(f"{name}: the shard record has no mesh coordinate for each of its "
                            f"placements ({shard}); this rank's place is unknown")
    idx: list[Runs] = [[(0, n)] if n else [] for n in gshape]
    for mdim, p in enumerate(placements):
        d, sf = _placement(p, name)
        if d is None:
            continue
        if d >= len(gshape) or sf < 1:
            raise SnapshotError(f"{name}: placement {p} of a {len(gshape)}-d tensor")
        idx[d] = _split(idx[d], int(mesh[mdim]), int(coord[mdim]), sf)
    got = [sum(n for _, n in r) for r in idx]
    if got != [int(n) for n in local_shape]:
        raise SnapshotError(
            f"{name}: a local shard of shape {list(local_shape)} where placements "
            f"[{', '.join(placements)}] on mesh {list(mesh)} at coordinate {list(coord)} of "
            f"global shape {gshape} give {got}")
    return idx


def boxes(name: str, shard: dict[str, Any] | None, local: Any) -> list[tuple[tuple[int, ...], Any]]:
    """The rectangular pieces of one rank's local tensor: (global offset, view of ``local``).
    One piece for a plain tensor or ``Shard``/``Replicate`` placements; a ``_StridedShard``
    holds several runs of a dimension, one piece per combination of runs."""
    shape = list(local.shape)
    if shard is None:
        return [(tuple(0 for _ in shape), local)]
    per_dim = []
    for runs in local_indices(name, shard, shape):
        pos, dim = 0, []
        for g, n in runs or [(0, 0)]:
            dim.append((pos, g, n))
            pos += n
        per_dim.append(dim)
    if all(len(d) == 1 and d[0][2] == n for d, n in zip(per_dim, shape)):
        return [(tuple(d[0][1] for d in per_dim), local)]  # one run per dim: the whole tensor
    out = []
    for combo in itertools.product(*per_dim):
        view = local[tuple(slice(a, a + n) for a, _, n in combo)]
        out.append((tuple(g for _, g, _ in combo), view))
    return out


def _check_cover(name: str, ent: dict[str, Any]) -> None:
    """SnapshotError unless the distinct chunks cover the global tensor exactly once."""
    shape = [int(n) for n in ent["shape"]]
    total = math.prod(shape)
    got = [(off, list(t.shape)) for off, (_, t) in ent["chunks"].items() if t.numel()]
    covered = sum(math.prod(s) for _, s in got)
    if covered != total:
        raise SnapshotError(f"{name}: the ranks' shards cover {covered} of {total} "
                            "elements (files of a rank missing?)")
    if len(got) > 256:  # pairwise below; a mask past that
        import torch

        mask = torch.zeros(shape, dtype=torch.int8)
        for off, s in got:
            mask[tuple(slice(o, o + n) for o, n in zip(off, s))] += 1
        ok = bool((mask == 1).all())
    else:
        ok = not any(all(a < c + m and c < a + n for a, n, c, m in zip(o1, s1, o2, s2))
                     for (o1, s1), (o2, s2) in itertools.combinations(got, 2))
    if not ok:
        raise SnapshotError(f"{name}: the ranks' shards overlap (a damaged shard record?)")


def _param_order(okey: str, lists: dict[int, list[str]], groups: dict[int, list[dict[str, Any]]]
                 ) -> dict[str, int]:
    """The merged parameter order of optimizer ``okey``: group by group, rank by rank, each
    FQN once (every merged group a contiguous range, as the host state stores groups)."""
    if len({len(g) for g in groups.values()}) > 1:
        raise ConfigError(f"optimizer {okey!r} has {sorted({len(g) for g in groups.values()})} "
                          "param groups on different ranks; its stages cannot be merged")
    seen: dict[str, int] = {}
    for gi in range(len(next(iter(groups.values()), []))):
        for r in sorted(groups):
            for i in groups[r][gi]["params"]:
                seen.setdefault(lists[r][i], len(seen))
    for r in sorted(lists):  # (a parameter in no group: after the others)
        for f in lists[r]:
            seen.setdefault(f, len(seen))
    return seen


def _merged_groups(okey: str, seen: dict[str, int], lists: dict[int, list[str]],
                   groups: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's param groups with every rank's parameters (``param_names`` merged alike)."""
    r0 = min(groups)
    out = []
    for gi, g0 in enumerate(groups[r0]):
        names: dict[int, Any] = {}
        for r in sorted(groups):
            g = groups[r][gi]
            pn = g.get("param_names")
            for pos, i in enumerate(g["params"]):
                names[seen[lists[r][i]]] = pn[pos] if isinstance(pn, list) and \
                    len(pn) == len(g["params"]) else None
            differ = sorted(k for k in g if k not in ("params", "param_names")
                            and g.get(k) != g0.get(k))
            if differ:
                log.warning("optimizer %r param group %d: rank %d has other %s than rank %d; "
                            "the export keeps rank %d's", okey, gi, r, differ, r0, r0)
        idx = sorted(names)
        if idx and idx != list(range(idx[0], idx[0] + len(idx))):
            raise ConfigError(f"optimizer {okey!r}: param group {gi} holds parameters that are "
                              "in other groups on other ranks; its stages cannot be merged")
        g = {k: v for k, v in g0.items() if k != "params"}
        if "param_names" in g0 and all(names[i] is not None for i in idx):
            g["param_names"] = [names[i] for i in idx]
        g["params"] = [idx[0] if idx else 0, len(idx)]
        out.append(g)
    return out


def optim_merge(ranks: list[dict[str, Any]]) -> tuple[dict[tuple[int, str], list[int]],
                                                      dict[str, Any], dict[str, Any]]:
    """Optimizers holding different parameters on different ranks (pipeline stages) matched
    by parameter FQN (the manifest's ``dcp_names["optim"]``), never by the per-rank index.

    Returns ({(rank, optimizer key): merged index of each local parameter index} for those
    optimizers only, {optimizer key: merged parameter FQNs}, {optimizer key: merged host
    state (param groups, scalar state)}); an optimizer whose parameters are the same on
    every rank (data and tensor parallel) keeps rank 0's as they are."""
    fqns = {r["rank"]: (r["manifest"].get("dcp_names") or {}).get("optim") or {} for r in ranks}
    hosts = {r["rank"]: codec.decode(r["manifest"]["host"], "host").get("optim") or {}
             for r in ranks}
    r0 = min(hosts)
    maps: dict[tuple[int, str], list[int]] = {}
    merged_fqns: dict[str, Any] = dict(fqns[r0])
    merged_host: dict[str, Any] = dict(hosts[r0])
    for okey in sorted({k for h in hosts.values() for k in h}):
        have = sorted(r for r in hosts if okey in hosts[r])
        lists = {r: fqns[r].get(okey) for r in have}
        if all(lists[r] == lists[have[0]] for r in have) and okey in hosts[r0]:
            continue
        if any(v is None or None in v for v in lists.values()):
            raise ConfigError(
                f"optimizer {okey!r} holds different parameters on different ranks (pipeline "
                "stages?) and the snapshot does not name each of them (dcp_names): its state "
                "cannot be matched across ranks")
        named = {r: list(v) for r, v in lists.items() if v is not None}
        groups = {r: [expand_params(g) for g in hosts[r][okey].get("param_groups", [])]
                  for r in have}
        seen = _param_order(okey, named, groups)
        for r in have:
            maps[(r, okey)] = [seen[f] for f in named[r]]
        scalars = {(maps[(r, okey)][int(i)], str(k)): v for r in have
                   for i, k, v in hosts[r][okey].get("scalars", [])}
        merged_fqns[okey] = list(seen)
        merged_host[okey] = {**hosts[have[0]][okey],
                             "param_groups": _merged_groups(okey, seen, named, groups),
                             "scalars": [[i, k, v] for (i, k), v in sorted(scalars.items())]}
        log.info("optimizer %r: its parameters differ across ranks %s (pipeline stages); "
                 "merged by FQN (%d parameters)", okey, have, len(seen))
    return maps, merged_fqns, merged_host


def _renamed(name: str, gkey: str, old: int, new: int) -> str:
    prefix = f"{gkey}.state.{old}."
    if not name.startswith(prefix):
        raise SnapshotError(f"{name}: an optimizer state tensor not named "
                            f"{prefix}<key>; its stages cannot be merged by FQN")
    return f"{gkey}.state.{new}.{name[len(prefix):]}"


def _chunks(ranks: list[dict[str, Any]],
            maps: dict[tuple[int, str], list[int]] | None = None) -> dict[str, dict[str, Any]]:
    """Per tensor name: dtype, global shape, and its distinct chunks {global offset: (rank,
    local view)} (a replicated chunk once, from the lowest rank holding it; a strided shard
    as several), checked to cover the tensor exactly once. Optimizer state of pipeline stages
    is renamed to its merged parameter index (``optim_merge``; ``maps`` when computed)."""
    if maps is None:
        maps = optim_merge(ranks)[0]
    out: dict[str, dict[str, Any]] = {}
    for r in sorted(ranks, key=lambda x: x["rank"]):
        for e in r["manifest"]["tensors"]:
            name, pidx = e["name"], e.get("param_index")
            kind, _, gkey = e["group"].partition(":")
            remap = maps.get((r["rank"], gkey)) if kind == "optim" and pidx is not None else None
            if remap is not None:
                name, pidx = _renamed(name, gkey, int(pidx), remap[int(pidx)]), \
                    remap[int(pidx)]  # type: ignore[index]
            sh = e.get("shard")
            gshape = list(sh["global_shape"]) if sh is not None else list(e["shape"])
            ent = out.setdefault(name, {"dtype": e["dtype"], "shape": gshape, "chunks": {},
                                        "group": e["group"], "aliases": e.get("aliases", []),
                                        "param_index": pidx, "state_key": e.get("state_key"),
                                        "rank": r["rank"]})
            ent.update({"subclass": e["subclass"]} if "subclass" in e else {})  # fold()'s
            if ent["shape"] != gshape or ent["dtype"] != e["dtype"]:
                raise SnapshotError(
                    f"{name}: ranks disagree on its global shape or dtype (rank {ent['rank']}: "
                    f"{ent['shape']} {ent['dtype']}, rank {r['rank']}: {gshape} {e['dtype']})")
            local = r["tensors"][e["name"]]
            for off, view in boxes(name, sh, local):
                if view.numel() or not math.prod(gshape):
                    ent["chunks"].setdefault(off, (r["rank"], view))
    for name, ent in out.items():
        _check_cover(name, ent)
    return out


def _union_names(ranks: list[dict[str, Any]], merged_fqns: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0's ``dcp_names`` with every rank's renames, views and hooked modules (pipeline
    stages hold different modules) and the merged optimizer FQNs."""
    names = [r["manifest"].get("dcp_names") for r in sorted(ranks, key=lambda x: x["rank"])]
    if names[0] is None or not isinstance(names[0], dict):
        return names[0]
    out = dict(names[0])
    for field in ("model", "views", "hooked"):
        merged: dict[str, Any] = {}
        for n in names:
            for k, v in ((n or {}).get(field) or {}).items():
                if field == "hooked" and k in merged and isinstance(v, list):
                    merged[k] = list(dict.fromkeys([*merged[k], *v]))
                else:
                    merged.setdefault(k, v)
        if merged or field == "model":
            out[field] = merged
    out["optim"] = merged_fqns
    return out


@dataclass
class Gathered:
    """A multi-rank step read offline: every tensor's chunks (``_chunks``), rank 0's
    manifest with the ranks' ``dcp_names`` merged, rank 0's host state with the optimizers'
    merged (``optim_merge``), and the other ranks' host states."""

    step: int
    ranks: list[dict[str, Any]]
    chunks: dict[str, dict[str, Any]]
    manifest: dict[str, Any]
    host: dict[str, Any]
    other_hosts: list[dict[str, Any]]


def gather(directory: Path, step: int | None = None) -> Gathered:
    """``load_shards`` and everything the exports need of it (``Gathered``)."""
    step_, ranks = load_shards(directory, step)
    maps, fqns, optim_host = optim_merge(ranks)
    chunks = _chunks(ranks, maps)
    ordered = sorted(ranks, key=lambda x: x["rank"])
    m0 = dict(ordered[0]["manifest"])
    if "dcp_names" in m0:
        m0["dcp_names"] = _union_names(ranks, fqns)
    host = codec.decode(m0["host"], "host")
    if host.get("optim") is not None or optim_host:
        host["optim"] = optim_host
    others = [codec.decode(r["manifest"]["host"], "host") for r in ordered[1:]]
    return Gathered(step_, ranks, chunks, m0, host, others)


def _assemble(name: str, ent: dict[str, Any]) -> Any:
    """The full tensor of one ``_chunks`` entry (its chunks laid into place)."""
    import torch

    if (whole := wrapped_entries.whole(ent)) is not None:  # an unsharded subclass value
        return whole
    full = torch.empty(ent["shape"], dtype=torch_dtype(ent["dtype"]))
    covered = 0
    for off, (_, t) in ent["chunks"].items():
        full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
        covered += t.numel()
    if covered != full.numel():  # (``_chunks`` checked the cover; an entry made otherwise)
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
