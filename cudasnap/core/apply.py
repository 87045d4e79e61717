"""How a snapshot is put back into the live objects (split from cudasnap.core.state).

``apply_snapshot`` (``TrainingState.apply``) checks the snapshot against the live state
(``check_compatible``: model tensor names, shapes, dtypes, shard records; ``check_classes``:
optimizer and LR scheduler classes), then copies every tensor (model and optimizer state)
in one call, then puts back the host state (optimizer scalars and param groups, ``extra``
objects, RNG states). The data is a verified uint8 tensor (a slot, or ``read_data``) or a
storage's byte source (``SnapshotFile``: ``storage.data_file.DataFile``, opened and checked,
not read) that this module plans the copies from and ``core.file_copy`` reads chunk by chunk
straight into the live tensors (``_copy_from_file``) where ``scatters`` says it can: the
restore calls down only, never back into the storage to copy.

It needs of the state only the registered objects and the walk (``Registered``; a
``TrainingState`` is one): cudasnap.core.state imports this module, never the reverse.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

import torch

from ..config import WAIT_S
from ..errors import IncompatibleSnapshot
from ..format import codec
from ..format.manifest import TensorEntry, dtype_key, dtype_name
from . import copy_back, device_restore, file_copy, optim_apply, sharded, values, wrapped
from .copy_back import Pair
from .live_tensor import _PLAIN, LiveTensor, _param_order
from .rng import DRAWN_KEY, RestoredRng

if TYPE_CHECKING:
    from .types import SnapshotFile, Stateful


class Registered(Protocol):
    """What a restore needs of a ``TrainingState``: the registered objects and the walk."""

    models: dict[str, torch.nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    extra: dict[str, object]
    restored_rng: RestoredRng
    rng_sources: tuple[str, ...]

    def live_tensors(self) -> list[LiveTensor]: ...


def check_classes(state: Registered, hd: object, where: str) -> None:
    """IncompatibleSnapshot when an optimizer (or LR scheduler) is of another class than the
    one snapshotted; snapshots without the recorded class (older format) pass."""
    if not isinstance(hd, dict):
        return
    for key, obj, saved in [(k, o, (hd.get("optim") or {}).get(k)) for k, o in
                            state.optimizers.items()] + [
            (k, o, (hd.get("extra") or {}).get(k)) for k, o in state.extra.items()
            if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]:
        was = saved.get("class") if isinstance(saved, dict) else None
        if isinstance(was, str) and was != type(obj).__qualname__:
            what = "optimizer" if key in state.optimizers and obj is state.optimizers[key] \
                else "extra"
            raise IncompatibleSnapshot(
                f"{where}: {what} {key!r} is {was} in the snapshot but "
                f"{type(obj).__qualname__} here; restore it into a {was}")


def _unexpanded(t: torch.Tensor, e: TensorEntry) -> tuple[torch.Tensor, TensorEntry]:
    """(``t``, ``e``) as a restore can write them: an ``expand()``ed tensor (a stride-0 dim
    of size > 1: its elements overlap, which ``copy_`` refuses to write) is written through
    index 0 of each such dim, in ``t`` and in the snapshot entry ``e`` alike (same bytes:
    a stride-0 dim adds none to the span)."""
    stride = t.stride() if t.layout == torch.strided else ()
    if 0 not in stride:
        return t, e
    shape = list(t.shape)
    dims = [d for d, (n, st) in enumerate(zip(shape, stride)) if st == 0 and n > 1]
    if not dims or list(e.get("stride", ())) != list(stride) or e.get("shape") != shape:
        return t, e  # nothing overlaps, or not this layout: copy_back decides
    for d in dims:
        shape[d] = 1
        t = t.narrow(d, 0, 1)
    return t, {**e, "shape": shape}


@contextlib.contextmanager
def _gc_held() -> Iterator[None]:
    """Python's cyclic GC held off (re-enabled only if it was on). A restore makes several
    container objects per tensor (entries, pairs, Refs, the optimizer's state dicts) that
    live through young collections: at 4,000 tensors they can set off a full collection of
    the whole process inside the restore (~0.2 s measured beside a 0.2 s restore, issue 26),
    which is not the restore's work; it then runs where the program next allocates."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _copy_from_file(pairs: list[Pair], data: torch.Tensor, file: SnapshotFile,
                    before: Callable[[], None] | None) -> None:
    """``copy_back.copy_into(pairs, data)`` with ``data`` still on disk: ``file`` (the
    storage's byte source) is read chunk by chunk into a small buffer, each chunk's CRC32C
    checked, and only then its bytes copied to the destinations (``file_copy.run_plan``: one
    native call, GIL released, no buffer of the file's size).

    ``data``: an untouched ``torch.empty`` of the file's size, standing for the file. The
    byte-copy pairs are planned against it as copy_into plans them (``_C.plan_pairs``, no
    Python call per pair: an offset in ``data`` is the offset in the file); the rest (torch's
    ``copy_``: non-contiguous or overlapping destinations, dtype views) read their bytes from
    ``data``, so the same call reads those byte ranges (verified alike) into it first, and
    only those pages of it are touched. The views are built and ``before()`` runs before
    the first read, as in copy_into.

    A chunk failing its CRC32C raises CorruptSnapshot before any byte of it is copied;
    chunks verified before it may have been copied (``partly_applied`` on the exception,
    see ``core.file_copy``); torch's copies have not run then.
    """
    from .._native import native

    lo, size = data.data_ptr(), file.nbytes
    plan = native().plan_pairs([d for d, _ in pairs], [s for _, s in pairs], copy_back._dtypes(),
                               _PLAIN, torch.Tensor, lo, size)
    slow = plan.slow
    rest = [(pairs[i][0], copy_back.entry_view(data, s) if type(s) is dict else cast(torch.Tensor, s))
            for i in slow for s in (pairs[i][1],)]
    extra = copy_back.ranges_read(rest, lo, size)
    if before is not None:
        before()
    file_copy.run_plan(file, plan, extra)
    with torch.no_grad():
        for d, s in rest:
            d.copy_(s)


def check_compatible(state: Registered, tensors: list[TensorEntry], where: str,
                     live_tensors: list[LiveTensor] | None = None) -> None:
    """Raises IncompatibleSnapshot naming the first model tensor that differs.
    ``live_tensors``: ``state.live_tensors()`` when the caller has it already."""
    lts = state.live_tensors() if live_tensors is None else live_tensors
    live = {lt.name: lt for lt in lts if lt.group.startswith("model:")}
    for lt in list(live.values()):
        for a in lt.aliases:
            live[a] = lt
    snap = {e["name"]: e for e in tensors if e.get("group", "").startswith("model:")}
    for name, e in snap.items():
        match = live.get(name)
        if match is None and "wrapper" in e and e["wrapper"]["of"] in live:
            match = live[e["wrapper"]["of"]]  # a plain tensor where the snapshot's subclass was
        if match is None:
            raise IncompatibleSnapshot(
                f"{where}: snapshot tensor {name!r} has no counterpart in the live model")
        if match.shard or e.get("shard"):
            sharded.check_same(name, e.get("shard"), match.shard, where)
        if match.wrapper is not None or "wrapper" in e:
            _check_wrapper(name, e.get("wrapper"), match, where)
        t = match.tensor
        if list(t.shape) != e["shape"]:
            raise IncompatibleSnapshot(f"{where}: {name!r} has shape {e['shape']} in the "
                                       f"snapshot, {list(t.shape)} in the live model")
        if dtype_key(t.dtype) != e["dtype"]:
            raise IncompatibleSnapshot(f"{where}: {name!r} has dtype {e['dtype']} in the "
                                       f"snapshot, {dtype_name(t.dtype)} in the live model")
    names = {lt.name for lt in live.values()}
    missing = sorted(names - set(snap) - {a for lt in live.values() for a in lt.aliases})
    if missing:
        raise IncompatibleSnapshot(
            f"{where}: live model tensor {missing[0]!r} is missing from the snapshot")
    groups = {e.get("group") for e in tensors}
    if any(isinstance(g, str) and g.startswith("optim:") for g in groups):
        for okey in state.optimizers:
            if f"optim:{okey}" not in groups:
                raise IncompatibleSnapshot(f"{where}: no state for optimizer {okey!r}")


def _check_wrapper(name: str, rec: wrapped.Record | None, live: LiveTensor, where: str) -> None:
    """IncompatibleSnapshot unless model tensor ``name`` is an inner tensor of the same
    tensor subclass (class, context, shape) in the snapshot and in the live model: its
    bytes mean something else otherwise."""
    if rec is not None and live.wrapper is not None and wrapped.same_kind(live.wrapper.outer, rec):
        return
    was = f"an inner tensor of a {rec.get('class')}" if rec else "a plain tensor"
    now = (f"an inner tensor of a {wrapped.class_path(type(live.wrapper.outer))}"
           if live.wrapper is not None else "a plain tensor")
    raise IncompatibleSnapshot(
        f"{where}: {name!r} is {was} in the snapshot but {now} in the live model (or the "
        "subclass's context or shape differs); restore into a model built the same way")


def apply_snapshot(state: Registered, tensors: list[TensorEntry], host: dict[str, object],
                   data: torch.Tensor | SnapshotFile, where: str,
                   before_copy: Callable[[], None] | None = None, wait_s: float = WAIT_S
                   ) -> tuple[int, dict[str, object]]:
    """Copies a snapshot into the live objects of ``state``; returns its step and the values
    saved with it (``boundary(step, **values)``; ``TrainingState.apply`` keeps them).

    Every check runs before the first byte is copied; then all tensors (model and
    optimizer state) go through one ``copy_back.copy_into`` call; then the host state.
    ``before_copy``: called after the checks, before the first byte (it may raise).

    ``data``: the snapshot's bytes, a uint8 tensor (verified), or a storage's byte source
    (``PosixStorage.open_data``'s ``storage.data_file.DataFile``: checked, not read). A file
    is read chunk by chunk straight into the live tensors (``_copy_from_file``, or
    ``device_restore.copy_to_device`` for one CUDA device: each chunk's CRC32C checked before
    any byte of it is copied) when nothing is sharded and the live tensors are on the CPU
    (``scatters``) or one device (``device_scatters``), else whole first
    (``file_copy.read_whole``); it is closed once read. A chunk failing its check then raises CorruptSnapshot with
    ``partly_applied`` telling whether earlier chunks were copied already.

    Python's cyclic GC is held off meanwhile (``_gc_held``), as in the layout build.
    """
    with _gc_held():
        if isinstance(data, torch.Tensor):
            return _apply_state(state, tensors, host, data, None, where, before_copy, wait_s)
        with data:  # a byte source (DataFile): closed however the restore ends
            return _apply_state(state, tensors, host, None, data, where, before_copy, wait_s)


def _apply_state(state: Registered, tensors: list[TensorEntry], host: dict[str, object],
                 data: torch.Tensor | None, file: SnapshotFile | None, where: str,
                 before_copy: Callable[[], None] | None, wait_s: float
                 ) -> tuple[int, dict[str, object]]:
    lts = state.live_tensors()  # once per restore: it walks every module and optimizer
    check_compatible(state, tensors, where, lts)
    hd = codec.decode(host, "host")
    check_classes(state, hd, where)  # before anything is changed
    device = None
    if file is not None:  # the storage's byte source: not read yet
        device = device_scatters(state, lts, tensors) if file.nbytes else None
        if file.nbytes and (device is not None or scatters(state, lts, tensors)):
            # Address space only (no page is touched): the planner's stand-in for the
            # file, and where the bytes torch's copy_ reads (if any) are read to.
            data = torch.empty(file.nbytes, dtype=torch.uint8)
        else:  # a destination torch must copy to (sharded, several devices): the whole file
            data, file = file_copy.read_whole(file), None
    assert data is not None
    live = {lt.name: lt for lt in lts}
    for lt in lts:
        for a in lt.aliases:
            live[a] = lt
    by_group: dict[str, list[TensorEntry]] = {}
    for e in tensors:
        by_group.setdefault(e["group"], []).append(e)
    # Model tensors by entry: copy_back builds a view only where torch must copy.
    pairs: list[Pair] = [_unexpanded(live[e["name"]].tensor, e)
                                    for g, es in by_group.items()
                                    if g.startswith("model:") for e in es]
    finish: list[Callable[[], None]] = []
    for okey, opt in state.optimizers.items():
        more, done = optim_apply.prepare_optimizer(okey, opt, by_group.get(f"optim:{okey}", []),
                                        hd.get("optim", {}).get(okey), where, data)
        pairs += more
        finish.append(done)
    # Contiguous CPU tensors: one multi-threaded native copy (copy_back.copy_into), or
    # from a file: read, verified and copied chunk by chunk (_copy_from_file).
    if file is None:
        copy_back.copy_into(pairs, data, before=before_copy)
    elif device is not None:
        device_restore.copy_to_device(pairs, data, file, device, before_copy, wait_s)
    else:
        _copy_from_file(pairs, data, file, before_copy)
    for done in finish:
        done()
    for mod in state.models.values():  # gradients are no state: none, as in a new process
        for p in mod.parameters():     # (a step that failed half-way, a NaN's backward,
            p.grad = None              # left some; the next backward would add to them)
    for key, obj in state.extra.items():
        ent = hd.get("extra", {}).get(key)
        if ent is None:
            raise IncompatibleSnapshot(f"{where}: no state for extra[{key!r}]")
        if isinstance(obj, torch.Generator):
            obj.set_state(ent["state"])
        elif ent.get("kind") == "value" or not callable(getattr(obj, "load_state_dict", None)):
            values.restore_into(obj, ent["state"], key, where)
        else:
            cast("Stateful", obj).load_state_dict(ent["state"])
    saved = dict(hd.get("values") or {})
    state.restored_rng.restored(hd.get("rng", {}), saved.pop(DRAWN_KEY, None),
                                state.rng_sources)
    return int(hd.get("step", -1)), saved


def device_scatters(state: Registered, lts: list[LiveTensor],
                    tensors: list[TensorEntry]) -> int | None:
    """The CUDA device a restore from a file can go to chunk by chunk through page-locked
    buffers (``device_restore.copy_to_device``; CPU tensors beside it, e.g. Adam's ``step``, are copied
    from the same chunks), or None: no CUDA tensor, several devices, a CPU-only build, or
    anything sharded (``scatters``' rule)."""
    from .._native import native

    devs = {lt.tensor.device.index for lt in lts if lt.tensor.is_cuda}
    if len(devs) != 1 or not hasattr(native(), "read_file_to_device"):
        return None
    if any(lt.shard or lt.owner is not None for lt in lts) or any("shard" in e for e in tensors):
        return None
    dt_cls = sharded._dtensor_cls()
    if dt_cls is not None and any(isinstance(p, dt_cls) for opt in state.optimizers.values()
                                  for p in _param_order(opt)):
        return None
    (dev,) = devs
    return int(dev if dev is not None else torch.cuda.current_device())


def scatters(state: Registered, lts: list[LiveTensor], tensors: list[TensorEntry]) -> bool:
    """Whether a restore from a file can go chunk by chunk into the live tensors
    (``_copy_from_file``): every live tensor on the CPU and nothing sharded (a DTensor's
    value is built from the snapshot's bytes before the copy, so they must be read)."""
    if any(not lt.tensor.is_cpu or lt.shard or lt.owner is not None for lt in lts):
        return False
    if any("shard" in e for e in tensors):
        return False
    dt_cls = sharded._dtensor_cls()
    return dt_cls is None or not any(isinstance(p, dt_cls) for opt in state.optimizers.values()
                                     for p in _param_order(opt))
