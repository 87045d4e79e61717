"""The keys of ``cudasnap export --to dcp``: a snapshot's tensors and host state named as
``torch.distributed.checkpoint`` loaders ask for them.

Three readers, one checkpoint. Every name below points at the same stored bytes (the DCP
metadata lists each key with the storage of the first: no tensor is written twice):

- ``get_state_dict`` (``torch.distributed.checkpoint.state_dict``, default options) then
  ``dcp.load({"model": msd, "optim": osd})`` then ``set_state_dict``:
  ``model.<fqn>``; ``optim.state.<param fqn>.<key>``; ``optim.param_groups.<i>.<key>``
  (``params``: the group's parameter FQNs). FQNs are the ones ``get_state_dict`` gives:
  wrapper prefixes (DDP ``module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``) dropped.
- torchtitan's ``CheckpointManager`` (``flatten_optimizer_state_dict=True``, model keys at the
  top level): ``<fqn>``; ``optimizer.state.<param fqn>.<key>``;
  ``optimizer.param_groups.<param fqn>.<key>``; ``train_state.step`` (int32 tensor: the
  step the snapshot was taken after, as torchtitan's ``TrainState.step``); ``lr_scheduler.*``
  (the state of the one LR scheduler registered in ``extra``, or of ``extra["lr_scheduler"]``).
- cudasnap's own ``load_resharded`` and exports before the FQN names:
  ``optim.state.<param index>.<key>``.

Every ``extra`` object's state goes under its own name (``extra={"dataloader": dl}`` ->
``dataloader.*``): rank 0's copy, plus the keys only other ranks have (extra state is per
rank: torchtitan's dataloader saves ``dp_rank_<N>`` on rank N, and its loader asks for every
rank's). Only the first form exists for a
snapshot without recorded FQNs (taken before this export learnt them) or with several models
or optimizers (keys then prefixed by their ``Snapshotter`` names).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptSnapshot
from ..format.manifest import expand_params

log = logging.getLogger("cudasnap.export")

TORCHTITAN_OPTIM = "optimizer"
TORCHTITAN_SCHEDULER = "lr_scheduler"
TORCHTITAN_TRAIN_STATE = "train_state"


@dataclass
class DcpKeys:
    """What ``export_dcp`` writes: ``tensors`` maps a snapshot tensor (a ``_chunks`` entry)
    to its DCP keys (its bytes stored once, under the first); ``objects`` are values written
    from rank 0 (non-tensors pickled by DCP's own ``torch.save`` rule, small tensors as one
    chunk); ``same_as`` maps a key to an ``objects`` key whose stored bytes it shares."""

    tensors: dict[str, list[str]] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    same_as: dict[str, str] = field(default_factory=dict)
    fqn_keys: bool = False  # the get_state_dict names were written

    def all_keys(self) -> list[str]:
        return [k for ks in self.tensors.values() for k in ks] + [*self.objects, *self.same_as]


def _names(manifest: dict[str, Any]) -> tuple[dict[str, str], dict[str, list[str | None]]]:
    """(renamed model tensors, parameter FQNs per optimizer) recorded in the manifest."""
    raw = manifest.get("dcp_names")
    if raw is None:
        return {}, {}
    ok = (isinstance(raw, dict) and isinstance(raw.get("model"), dict)
          and isinstance(raw.get("optim"), dict)
          and all(isinstance(k, str) and isinstance(v, str) for k, v in raw["model"].items())
          and all(isinstance(v, list) and all(x is None or isinstance(x, str) for x in v)
                  for v in raw["optim"].values()))
    if not ok:
        raise CorruptSnapshot("manifest field 'dcp_names' is malformed (expected "
                              "{'model': {name: name}, 'optim': {key: [fqn or null]}})")
    return raw["model"], raw["optim"]


def _flatten(tree: dict[str, Any]) -> dict[str, Any]:
    """DCP's own flattening of nested dicts and lists (the keys ``dcp.load`` looks up)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(tree)[0]


def _scheduler_extra(extra: dict[str, Any]) -> str | None:
    """The name of the one LR scheduler in ``extra`` (by its recorded class)."""
    if TORCHTITAN_SCHEDULER in extra:
        return TORCHTITAN_SCHEDULER
    import torch

    found = [k for k, v in extra.items() if isinstance(v, dict) and v.get("kind") == "state_dict"
             and isinstance(getattr(torch.optim.lr_scheduler, str(v.get("class")), None), type)
             and issubclass(getattr(torch.optim.lr_scheduler, str(v.get("class"))),
                            torch.optim.lr_scheduler.LRScheduler)]
    return found[0] if len(found) == 1 else None


class _Claims:
    """The keys taken so far: each key names one value (a clash is logged and left out)."""

    def __init__(self, out: DcpKeys) -> None:
        self.out, self.taken = out, set[str]()

    def claim(self, keys: list[str], what: str, strict: bool = False) -> list[str]:
        kept = []
        for k in keys:
            if k in self.taken:
                if strict and k == keys[0]:
                    raise CorruptSnapshot(f"{what}: DCP key {k!r} is used twice")
                log.warning("export --to dcp: key %r of %s is taken; that name is left out",
                            k, what)
                continue
            self.taken.add(k)
            kept.append(k)
        return kept

    def put(self, tree: dict[str, Any], what: str) -> None:
        for k, v in _flatten(tree).items():
            if self.claim([k], what):
                self.out.objects[k] = v


def _tensor_keys(name: str, ent: dict[str, Any], renamed: dict[str, str],
                 param_fqns: dict[str, list[Any]], titan: Titan) -> list[str]:
    """The keys of one tensor chunk entry: a model tensor under its state_dict names (and
    torchtitan's top-level ones), an optimizer state tensor under its parameter's FQN."""
    kind, _, gkey = ent["group"].partition(":")
    keys: list[str] = []
    if kind == "model":
        for n in (name, *ent["aliases"]):
            keys.append(renamed.get(n, n))
        keys += [n for n in (name, *ent["aliases"]) if n not in keys]  # the raw names too
        if titan:
            keys += [renamed.get(n, n)[len(gkey) + 1:] for n in (name, *ent["aliases"])]
    elif kind == "optim" and ent.get("param_index") is not None:
        idx, key = int(ent["param_index"]), str(ent["state_key"])
        fqns = param_fqns.get(gkey) or []
        fqn = fqns[idx] if idx < len(fqns) else None
        if fqn is not None:
            keys.append(f"{gkey}.state.{fqn}.{key}")
            if titan:
                keys.append(f"{TORCHTITAN_OPTIM}.state.{titan.fqn(fqn)}.{key}")
        keys.append(name)  # optim.state.<index>.<key>: load_resharded, old exports
    else:
        keys.append(name)
    return list(dict.fromkeys(keys))


@dataclass
class Titan:
    """torchtitan's CheckpointManager layout: one model (``model``) and optimizer, or its
    pipeline stages (models ``model.<i>``, one optimizer ``optim.<i>`` each, as
    cudasnap.integrations.torchtitan registers a rank's model parts): model keys and
    parameter FQNs at the top level, a stage's ``model.<i>.`` prefix dropped."""

    models: list[str]

    def __bool__(self) -> bool:
        return bool(self.models)

    def fqn(self, fqn: str) -> str:
        for m in self.models:
            if len(self.models) > 1 and fqn.startswith(f"{m}."):
                return fqn[len(m) + 1:]
        return fqn

    @staticmethod
    def of(models: list[str], optims: list[str], named: bool) -> Titan:
        if not named:
            return Titan([])
        if models == ["model"] and len(optims) <= 1:
            return Titan(models)
        stage = re.compile(r"^(model|optim)\.\d+$")
        if models and all(stage.match(m) and m.startswith("model.") for m in models) and \
                all(stage.match(o) and o.startswith("optim.") for o in optims):
            return Titan(models)
        return Titan([])


def _optim_keys(c: _Claims, okey: str, h: dict[str, Any], param_fqns: dict[str, list[Any]],
                titan: Titan) -> None:
    """One optimizer's param groups and non-tensor state under get_state_dict's keys
    (nested, and flattened per parameter FQN when every parameter is named)."""
    fqns = param_fqns.get(okey) or []
    groups = [expand_params(g) for g in h.get("param_groups", [])]
    n_params = sum(len(g["params"]) for g in groups)
    named = len(fqns) == n_params and all(f is not None for f in fqns)
    if param_fqns and not named:
        log.warning("export --to dcp: optimizer %r has parameters outside the registered "
                    "model(s); its param groups keep parameter indices", okey)
    if named:
        for g in groups:
            g["params"] = [fqns[i] for i in g["params"]]
    # get_state_dict's default (nested) form: <okey>.param_groups.<i>.<key>
    c.put({okey: {"param_groups": groups}}, f"optimizer {okey!r} param groups")
    scalars = [(int(i), str(k), v) for i, k, v in h.get("scalars", [])]
    if not named:
        if scalars:
            c.put({okey: {"state": {str(i): {k: v} for i, k, v in scalars}}},
                  f"optimizer {okey!r} scalar state")
        return
    for prefix in (okey, TORCHTITAN_OPTIM) if titan else (okey,):
        top = titan.fqn if prefix == TORCHTITAN_OPTIM else str
        # flatten_optimizer_state_dict=True: <prefix>.param_groups.<fqn>.<key>, one
        # stored value per group and key, the other parameters' names point at it
        for gi, g in enumerate(groups):
            for k, v in g.items():
                if k == "params" or not g["params"]:
                    continue
                first: str | None = None
                for fqn in g["params"]:
                    tk = f"{prefix}.param_groups.{top(fqn)}.{k}"
                    if not c.claim([tk], f"param group {gi} of {okey!r}"):
                        continue
                    if first is None:
                        c.out.objects[first := tk] = v
                    else:
                        c.out.same_as[tk] = first
        for i, k, v in scalars:  # state that is no tensor: <prefix>.state.<fqn>.<key>
            c.put({f"{prefix}.state.{top(fqns[i])}.{k}": v}, f"optimizer {okey!r} scalar state")


def plan(chunks: dict[str, dict[str, Any]], manifest: dict[str, Any], host: dict[str, Any],
         step: int, other_hosts: Sequence[dict[str, Any]] = ()) -> DcpKeys:
    """The keys of every tensor chunk entry and host value (see the module doc).
    ``host``: rank 0's host state; ``other_hosts``: the other ranks', whose ``extra`` keys
    rank 0 lacks are added (per-rank state: torchtitan's ``dataloader.dp_rank_<N>``)."""
    import torch

    renamed, param_fqns = _names(manifest)
    out = DcpKeys(fqn_keys="dcp_names" in manifest)
    models = sorted({e["group"].partition(":")[2] for e in chunks.values()
                     if e["group"].startswith("model:")})
    optims = host.get("optim") or {}
    titan = Titan.of(models, sorted(optims), "dcp_names" in manifest)
    c = _Claims(out)
    # Tensors: model first (their names win a clash with the top-level torchtitan names).
    for name in sorted(chunks, key=lambda n: not chunks[n]["group"].startswith("model:")):
        out.tensors[name] = c.claim(_tensor_keys(name, chunks[name], renamed, param_fqns, titan),
                                    name, strict=True)
    for okey, h in optims.items():
        _optim_keys(c, okey, h, param_fqns, titan)
    extra = host.get("extra") or {}
    for name, ent in extra.items():
        if isinstance(ent, dict) and "state" in ent:
            c.put({name: ent["state"]}, f"extra[{name!r}]")
    for other in other_hosts:  # keys only another rank has (rank 0's copy wins a clash)
        for name, ent in (other.get("extra") or {}).items():
            if isinstance(ent, dict) and "state" in ent:
                for k, v in _flatten({name: ent["state"]}).items():
                    if k not in c.taken:
                        c.taken.add(k)
                        out.objects[k] = v
    if titan:
        sched = _scheduler_extra(extra)
        if sched is not None and sched != TORCHTITAN_SCHEDULER:
            c.put({TORCHTITAN_SCHEDULER: extra[sched]["state"]}, f"extra[{sched!r}]")
        if TORCHTITAN_TRAIN_STATE not in extra:
            c.put({TORCHTITAN_TRAIN_STATE: {"step": torch.tensor(step, dtype=torch.int32)}},
                  "train_state")
    return out
