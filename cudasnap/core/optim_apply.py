"""An optimizer's snapshot state put back (split from cudasnap.core.apply, which calls it).

``prepare_optimizer`` gathers a snapshot's optimizer entries by parameter and state key
(``_gather``: a tensor subclass's inner tensors into one ``SubclassValue``, a sharded
value as a DTensor on the parameter's mesh), then either copies the bytes into the live
state when it has the snapshot's shape (``_in_place``: a rollback, a warm optimizer) or
builds new state and hands it to ``load_state_dict`` (``_rebuilt``: a new optimizer).
Nothing is changed before every check passed: the caller copies the returned pairs in one
call, then runs the returned function.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import torch

from ..errors import IncompatibleSnapshot
from ..format.manifest import TensorEntry, expand_params
from . import copy_back, sharded, wrapped
from .copy_back import Pair
from .live_tensor import _param_order

# {param index: {state key: Ref | DTensor | SubclassValue | scalar}}
Gathered = dict[int, dict[str, object]]


def prepare_optimizer(okey: str, opt: torch.optim.Optimizer,
                       entries: list[TensorEntry], host: Mapping[str, object] | None,
                       where: str, data: torch.Tensor) -> tuple[list[Pair], Callable[[], None]]:
    """Checks an optimizer's snapshot state; returns the (live tensor, snapshot value)
    pairs to copy and what to run after the copy (scalars, param groups, or
    ``load_state_dict`` when the optimizer's state is not the snapshot's shape)."""
    if host is None:
        raise IncompatibleSnapshot(f"{where}: no host state for optimizer {okey!r}")
    params = _param_order(opt)
    state = _gather(opt, entries, host, where, data)
    done = _in_place(okey, opt, params, state, host, where)
    return done if done is not None else _rebuilt(okey, opt, state, host, where, data)


def _gather(opt: torch.optim.Optimizer, entries: list[TensorEntry],
            host: Mapping[str, object], where: str, data: torch.Tensor) -> Gathered:
    """The snapshot's state of ``opt`` by parameter index and state key."""
    params = _param_order(opt)
    dt_cls = sharded._dtensor_cls()  # once, not is_dtensor() per entry
    state: dict[int, dict[str, object]] = {}
    for e in entries:
        idx, key = e.get("param_index"), e.get("state_key")
        if not isinstance(idx, int) or not isinstance(key, str) or not 0 <= idx < len(params):
            raise IncompatibleSnapshot(f"{where}: optimizer tensor {e['name']!r} refers to "
                                       f"parameter {idx!r}; the optimizer has {len(params)}")
        p = params[idx]
        if "wrapper" in e:  # an inner tensor of a subclass value: gathered, then checked
            got = state.setdefault(idx, {}).get(key)
            if not isinstance(got, SubclassValue):
                got = state[idx][key] = SubclassValue(e, p)
            got.inner[e["wrapper"]["attr"]] = e
            continue
        state.setdefault(idx, {})[key] = copy_back.Ref(e) if "shard" not in e and not (
            dt_cls is not None and isinstance(p, dt_cls)) else sharded.like_param(
                copy_back.entry_view(data, e), e, p, where)
    for s in state.values():
        for v in s.values():
            if isinstance(v, SubclassValue):
                v.check(where)
    # (param index, state key, value) of each scalar (TrainingState.capture_host)
    for idx, key, value in cast("list[tuple[int, str, object]]", host.get("scalars", [])):
        state.setdefault(int(idx), {})[key] = value
    return state


def _in_place(okey: str, opt: torch.optim.Optimizer, params: list[torch.Tensor],
              state: Gathered, host: Mapping[str, object], where: str
              ) -> tuple[list[Pair], Callable[[], None]] | None:
    """The copies into the live state and the host values to set after them, when the live
    state has the snapshot's shape (rollback, or a warm optimizer); None otherwise."""
    if not (len(opt.state) == len(state) and all(
            params[i] in opt.state and set(opt.state[params[i]]) == set(s)
            and all(v.fits(opt.state[params[i]][k], where) if isinstance(v, SubclassValue) else
                    copy_back.fits_in_place(opt.state[params[i]][k], v) for k, v in s.items())
            for i, s in state.items())):
        return None
    pairs: list[Pair] = []
    scalars: list[tuple[dict[str, object], str, object]] = []
    for i, s in state.items():
        st = opt.state[params[i]]
        for k, v in s.items():
            if isinstance(v, SubclassValue):  # into the live subclass's inner tensors
                pairs += v.pairs_into(st[k])
            elif isinstance(v, copy_back.Ref):
                pairs.append((st[k], v.e))
            elif isinstance(v, torch.Tensor):
                pairs.append((st[k], v))
            else:
                scalars.append((st, k, v))
    groups = cast("list[dict[str, object]]", host["param_groups"])
    if len(groups) != len(opt.param_groups):
        raise IncompatibleSnapshot(f"{where}: optimizer {okey!r} has {len(opt.param_groups)}"
                                   f" param groups, the snapshot {len(groups)}")

    def set_host() -> None:
        for st, k, v in scalars:
            st[k] = v
        for g, saved in zip(opt.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    return pairs, set_host


def _rebuilt(okey: str, opt: torch.optim.Optimizer, state: Gathered,
             host: Mapping[str, object], where: str, data: torch.Tensor
             ) -> tuple[list[Pair], Callable[[], None]]:
    """New state tensors (filled by the returned copies) and the ``load_state_dict`` call
    that hands them to the optimizer."""
    expanded = [expand_params(g) for g in cast("list[dict[str, object]]", host["param_groups"])]
    clones: list[Pair] = []  # (new tensor, snapshot value): one native copy
    sd_state: dict[int, dict[str, object]] = {}
    for i, s in state.items():
        d: dict[str, object] = {}
        sd_state[i] = d
        for k, v in s.items():
            if isinstance(v, SubclassValue):  # a new subclass value around new inner tensors
                d[k], more = v.build(data, where)
                clones += more
            elif isinstance(v, copy_back.Ref):
                d[k] = new = copy_back.empty_like_entry(data, v.e)
                clones.append((new, v.e))
            elif isinstance(v, torch.Tensor):
                d[k] = new = torch.empty_like(v)
                clones.append((new, v))
            else:
                d[k] = v

    def load() -> None:
        try:
            opt.load_state_dict({"state": sd_state, "param_groups": expanded})
        except (ValueError, KeyError, RuntimeError) as e:
            raise IncompatibleSnapshot(
                f"{where}: optimizer {okey!r} rejects the snapshot: {e}") from e

    return clones, load


class SubclassValue:
    """An optimizer state value that is a tensor subclass (cudasnap.core.wrapped): its
    inner tensors' snapshot entries, gathered by ``_gather``; put back into a
    live value of the same kind (``fits``, ``pairs_into``) or built anew (``build``)."""

    def __init__(self, e: TensorEntry, param: torch.Tensor) -> None:
        self.rec: wrapped.Record = e["wrapper"]
        self.first = e  # its shard record (a DTensor's local shard) is the subclass's
        self.param = param
        self.inner: dict[str, TensorEntry] = {}

    def check(self, where: str) -> None:
        want = list(self.rec["inner"])
        if sorted(self.inner) != sorted(want):
            raise IncompatibleSnapshot(
                f"{where}: {self.rec['of']!r} ({self.rec['class']}) has inner tensors "
                f"{sorted(self.inner)} in the snapshot; its record names {want}")

    def _local(self, live: object, where: str) -> object:
        if sharded.is_dtensor(live):
            sharded.check_same(self.rec["of"], self.first.get("shard"), sharded.shard_info(live),
                               where)
            return sharded.local_shard(live)
        if self.first.get("shard"):
            sharded.check_same(self.rec["of"], self.first.get("shard"), None, where)
        return live

    def fits(self, live: object, where: str) -> bool:
        """Whether ``live`` is the same subclass (class, context, shape) with inner tensors
        of the snapshot's shapes and dtypes."""
        local = self._local(live, where)
        return wrapped.same_kind(local, self.rec) and all(
            copy_back.fits_in_place(getattr(local, a), copy_back.Ref(e))
            for a, e in self.inner.items())

    def pairs_into(self, live: object) -> list[Pair]:
        local = self._local(live, "restore")
        return [(getattr(local, a), e) for a, e in self.inner.items()]

    def build(self, data: torch.Tensor, where: str) -> tuple[torch.Tensor, list[Pair]]:
        """A new value (new inner tensors, the subclass rebuilt around them; a DTensor on
        the parameter's mesh when the parameter is one) and the copies that fill it."""
        new = {a: copy_back.empty_like_entry(data, e) for a, e in self.inner.items()}
        value = wrapped.rebuild(self.rec, new, where)
        if sharded.is_dtensor(self.param) or self.first.get("shard"):
            value = sharded.like_param(value, self.first, self.param, where)
        return value, [(new[a], e) for a, e in self.inner.items()]
