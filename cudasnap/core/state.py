"""What a snapshot holds.

``TrainingState`` collects the live tensors of the registered modules and
optimizers (by name, without copying), captures the host-side state at each
boundary (RNG states, optimizer hyper-parameters, ``extra`` objects) as typed
JSON, and applies a snapshot back: by name into freshly built objects
(new process) or byte-for-byte into the same live tensors (rollback).

It owns the registered objects and what is done with them as a whole: the layout walk
(``live_tensors``), the identity re-scan (``identity_pieces``), DCP names and the host
capture. How a snapshot is put back (checks, then one copy, then the host state) lives in
cudasnap.core.apply (``TrainingState.apply`` calls it; it needs only the registered
objects and the walk); a single tensor and its checks in cudasnap.core.live_tensor; RNG
capture and restore in cudasnap.core.rng.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from ..config import WAIT_S
from ..errors import ConfigError
from ..format.manifest import TensorEntry
from . import apply as apply_mod
from . import module_state, optim_wrap, peft_info, sharded, values, wrapped
from .live_tensor import _PLAIN, LiveTensor, _param_order, check_tensor, expand_wrapper
from .rng import RNG_SOURCES, RestoredRng, capture_rng

if TYPE_CHECKING:
    from .types import SnapshotFile, Stateful

_T = TypeVar("_T")


def _as_mapping(obj: object, default_key: str, kind: type[_T], what: str) -> dict[str, _T]:
    if obj is None:
        return {}
    if isinstance(obj, kind):
        return {default_key: obj}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str) or not isinstance(v, kind):
                raise ConfigError(f"{what}[{k!r}] must be a {kind.__name__}, got {type(v).__name__}")
        return dict(obj)
    raise ConfigError(f"{what} must be a {kind.__name__} or a dict of them, got {type(obj).__name__}")


def _optimizer_mapping(obj: object) -> dict[str, object]:
    if obj is None:
        return {}
    if optim_wrap.is_optimizer_like(obj):
        return {"optim": obj}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str) or not optim_wrap.is_optimizer_like(v):
                raise ConfigError(f"optimizer[{k!r}] must be a Optimizer, got {type(v).__name__}")
        return dict(obj)
    raise ConfigError(f"optimizer must be a Optimizer or a dict of them, got {type(obj).__name__}")


# Wrapper modules whose attribute name get_state_dict leaves out of a key (torch.compile,
# activation checkpointing, FSDP1); DDP's ``module`` only under a DistributedDataParallel.
_WRAPPER_ATOMS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def dcp_fqn(module: torch.nn.Module, key: str) -> str:
    """The key ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives the
    ``state_dict`` entry ``key`` of ``module``: the wrappers' attribute names dropped (DDP's
    ``module.``, torch.compile's ``_orig_mod.``, ``_checkpoint_wrapped_module.``,
    ``_fsdp_wrapped_module.``), as its ``_get_fqns`` does."""
    out: list[str] = []
    cur: object = module
    ddp = torch.nn.parallel.DistributedDataParallel
    for atom in key.split("."):
        nxt = cur._modules.get(atom) if isinstance(cur, torch.nn.Module) else None
        if atom not in _WRAPPER_ATOMS and not (atom == "module" and isinstance(cur, ddp)):
            out.append(atom)
        cur = nxt
    return ".".join(out)


class TrainingState:
    """The registered objects of one Snapshotter."""

    def __init__(self, model: object, optimizer: object = None,
                 extra: Mapping[str, object] | None = None):
        self.models = _as_mapping(model, "model", torch.nn.Module, "model")
        if not self.models:
            raise ConfigError("Snapshotter needs a torch.nn.Module (or a dict of them) as model")
        # Wrappers (torchtitan's OptimizersContainer, accelerate's AcceleratedOptimizer,
        # Lightning's LightningOptimizer) are replaced by the optimizers they step.
        self.optimizers, self.wrapped = optim_wrap.flatten(_optimizer_mapping(optimizer))
        self.extra: dict[str, object] = {}
        for key, obj in (extra or {}).items():
            if not isinstance(key, str):
                raise ConfigError(f"extra keys must be strings, got {key!r}")
            if isinstance(obj, torch.Generator):
                self.extra[key] = obj
            elif callable(getattr(obj, "state_dict", None)) and callable(
                    getattr(obj, "load_state_dict", None)):
                self.extra[key] = obj
            elif values.accepts(key, obj):  # tensor / dict / list: restored in place
                self.extra[key] = obj
            else:
                raise ConfigError(
                    f"extra[{key!r}] ({type(obj).__name__}) needs state_dict()/load_state_dict() "
                    "or must be a torch.Generator")
        self._scalar_keys: dict[str, list[tuple[int, str]]] = {}
        # boundary(step, **values): saved with the step; restore puts them in ``values``.
        self.step_values: dict[str, object] = {}
        self.values: dict[str, object] = {}
        self.rng_sources: tuple[str, ...] = RNG_SOURCES
        self.restored_rng = RestoredRng()  # a restore's RNG, again at the first forward
        # Refuse what cannot be copied now, not at the first boundary's copy (optimizer
        # state created later is checked when the layout is built).
        for mkey, mod in self.models.items():
            for name, t, _ in module_state.live(mod):
                check_tensor(f"{mkey}.{name}", t)
            module_state.check(mkey, mod)

    # ----------------------------------------------------------- layout
    def live_tensors(self) -> list[LiveTensor]:
        out: list[LiveTensor] = []
        by_id: dict[int, LiveTensor] = {}
        for mkey, mod in self.models.items():
            # The parameters and buffers themselves, never state_dict()'s values (a hook
            # may return copies: cudasnap.core.module_state).
            for name, t, is_buffer in module_state.live(mod):
                full = f"{mkey}.{name}"
                if id(t) in by_id:  # tied weights: one copy, two names
                    by_id[id(t)].aliases.append(full)
                    continue
                # Keep the Parameter object itself: `p.data = x` then shows as a moved pointer.
                lt = LiveTensor(full, f"model:{mkey}", t, 0 if is_buffer else 1)
                by_id[id(t)] = lt
                out.append(lt)
        for okey, opt in self.optimizers.items():
            scalars: list[tuple[int, str]] = []
            for idx, p in enumerate(_param_order(opt)):
                st = opt.state.get(p)
                if not st:
                    continue
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        out.append(LiveTensor(f"{okey}.state.{idx}.{k}", f"optim:{okey}",
                                              v, 1, idx, str(k)))
                    else:
                        scalars.append((idx, k))
            self._scalar_keys[okey] = scalars
        optim_wrap.check_wrappers(self.wrapped)
        flat: list[LiveTensor] = []
        for lt in out:  # at layout build (and construction), never per boundary
            check_tensor(lt.name, lt.tensor)
            if type(lt.tensor) in _PLAIN:
                flat.append(lt)
                continue
            if sharded.is_dtensor(lt.tensor):
                # sharded state: its local shard is copied (checked by check_tensor too)
                lt.owner, lt.shard = lt.tensor, sharded.shard_info(lt.tensor)
                lt.tensor = sharded.local_shard(lt.tensor)
            if wrapped.is_wrapper(lt.tensor):  # its inner tensors hold its bytes
                inner = expand_wrapper(lt)
                for it in inner:
                    check_tensor(it.name, it.tensor)
                flat += inner
            else:
                flat.append(lt)
        return flat

    # Tensors per piece of the periodic identity re-scan (~1 ms of Python each).
    SCAN_PIECE = 2048

    def identity_pieces(self, dedup: bool = True) -> Iterator[list[torch.Tensor]]:
        """The objects ``live_tensors()`` would list (``LiveTensor.ident``: the tensor a
        module or ``opt.state[p]`` holds), in its order, in pieces of ~``SCAN_PIECE``
        tensors. No LiveTensor, no checks: the periodic re-scan compares identities only
        (``Layout.rescan``; ``live_tensors()`` takes ~105 ms at 40,000 tensors).

        Models are walked module by module in ``live_tensors``' order (each module's
        parameters, then its persistent buffers, then its children: the default
        ``state_dict`` order, whatever hooks the modules have).
        ``dedup``: drop repeats of an object (tied weights; the layout lists them once);
        without it a repeat is a difference."""
        seen: set[int] = set()
        plain = (torch.Tensor, torch.nn.Parameter)

        def keep(ts: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
            out = [t for t in ts if t is not None and (type(t) in plain or
                                                       isinstance(t, torch.Tensor))]
            if dedup:
                out = [t for t in out if id(t) not in seen and not seen.add(id(t))]  # type: ignore[func-returns-value]
            return out

        for mod in self.models.values():
            if len(list(mod.modules())) != sum(1 for _ in mod.modules(remove_duplicate=False)):
                yield keep(t for _, t, _ in module_state.entries(mod))  # a module reached twice
                continue
            part: list[torch.Tensor] = []
            for m in mod.modules():
                nonp = m._non_persistent_buffers_set
                part += keep(m._parameters.values())
                part += keep(v for k, v in m._buffers.items() if k not in nonp)
                if len(part) >= self.SCAN_PIECE:
                    yield part
                    part = []
            yield part
        for opt in self.optimizers.values():
            params = _param_order(opt)
            st = opt.state
            step = max(1, self.SCAN_PIECE // 3)  # ~3 state tensors per parameter
            for lo in range(0, len(params), step):
                yield [v for p in params[lo:lo + step] for v in (st.get(p) or {}).values()
                       if type(v) in plain or isinstance(v, torch.Tensor)]

    def dcp_names(self) -> dict[str, object]:
        """The names ``get_state_dict`` would use, for ``cudasnap export --to dcp``:
        ``{"model": {tensor name: DCP name}}`` for the names that differ (wrappers' prefixes;
        DCP name = ``<model key>.<fqn>``) and ``{"optim": {optimizer key: [parameter FQN or
        None, in the optimizer's parameter order]}}`` (the model key prefixed when there are
        several models; None for a parameter of no registered model), and ``"hooked"``:
        ``{model key: [module paths]}`` whose state_dict a hook builds (only when there are
        any). Built with the layout, never per boundary."""
        renamed: dict[str, str] = {}
        fqn_of: dict[int, str] = {}
        multi = len(self.models) > 1
        for mkey, mod in self.models.items():
            for key, _, _ in module_state.live(mod):
                fqn = dcp_fqn(mod, key)
                if fqn != key:
                    renamed[f"{mkey}.{key}"] = f"{mkey}.{fqn}"
            for key, p in mod.named_parameters():  # first name of a tied one, as DCP
                fqn_of.setdefault(id(p), f"{mkey}.{dcp_fqn(mod, key)}" if multi
                                  else dcp_fqn(mod, key))
        optim = {okey: [fqn_of.get(id(p)) for p in _param_order(opt)]
                 for okey, opt in self.optimizers.items()}
        out: dict[str, object] = {"model": renamed, "optim": optim}
        hooked = {mkey: h for mkey, mod in self.models.items() if (h := module_state.hooked(mod))}
        if hooked:  # modules whose state_dict is built by hooks (export --to dcp warns)
            out["hooked"] = hooked
        peft = peft_info.describe(self.models)
        if peft:  # PEFT models: what an adapter / merged export needs (cudasnap.core.peft_info)
            out["peft"] = peft
        views: dict[str, dict[str, object]] = {}
        for mkey, mod in self.models.items():
            for path, rel, spec in module_state.views(mod):
                name = f"{mkey}.{module_state.drop_renamed(f'{path}.{rel}' if path else rel)}"
                base = dcp_fqn(mod, path) if path else ""
                views[name] = {**spec, "names": [f"{mkey}.{base}.{n}" if base else f"{mkey}.{n}"
                                                 for n in cast("list[str]", spec["names"])]}
        if views:  # keys a hook makes of these tensors, computed by the export
            out["views"] = views
        return out

    # ------------------------------------------------------- host state
    def capture_host(self, step: int, rng: bool = True, optim: bool = True) -> dict[str, object]:
        """Host-side state at a boundary, as codec-ready Python values: ``"step"``,
        ``"rng"``, then ``host_members``' members.

        ``rng=False``: no RNG state (``"rng": {}``); ``optim=False``: no ``"optim"`` key.
        The boundary reads those itself, only when they changed
        (cudasnap.core.host_capture.HostText)."""
        out: dict[str, object] = {"step": step,
                                  "rng": capture_rng(self.rng_sources) if rng else {}}
        out.update(self.host_members(optim))
        return out

    def host_members(self, optim: bool = True) -> dict[str, object]:
        """The host state but its step and RNG states, in order: ``"optim"`` (not with
        ``optim=False``), ``"extra"``, ``"values"`` (only if there are any)."""
        groups_of: dict[str, object] = {}
        for okey, opt in self.optimizers.items() if optim else ():
            groups = []
            idx = 0
            for g in opt.param_groups:
                n = len(g["params"])
                d = {k: v for k, v in g.items() if k != "params"}
                d["params"] = [idx, n]  # first index, count (expanded at restore)
                idx += n
                groups.append(d)
            keys = self._scalar_keys.get(okey, [])
            params = _param_order(opt) if keys else []  # O(params): only when needed
            scalars = [[i, k, opt.state[params[i]][k]] for i, k in keys
                       if params[i] in opt.state and k in opt.state[params[i]]]
            groups_of[okey] = {"param_groups": groups, "scalars": scalars,
                               "class": type(opt).__qualname__}
        extra: dict[str, object] = {}
        for key, obj in self.extra.items():
            if isinstance(obj, torch.Generator):
                extra[key] = {"kind": "generator", "state": obj.get_state()}
            elif not callable(getattr(obj, "state_dict", None)):
                extra[key] = {"kind": "value", "state": obj}
            else:
                extra[key] = {"kind": "state_dict", "state": cast("Stateful", obj).state_dict(),
                              "class": type(obj).__qualname__}
        out: dict[str, object] = {"optim": groups_of, "extra": extra}
        if not optim:
            del out["optim"]
        if self.step_values:
            out["values"] = self.step_values
        return out

    # ------------------------------------------------------------ apply
    def check_compatible(self, tensors: list[TensorEntry], where: str,
                         live_tensors: list[LiveTensor] | None = None) -> None:
        """Raises IncompatibleSnapshot naming the first model tensor that differs
        (``core.apply.check_compatible``)."""
        apply_mod.check_compatible(self, tensors, where, live_tensors)

    def apply(self, tensors: list[TensorEntry], host: dict[str, object],
              data: torch.Tensor | SnapshotFile, where: str, before_copy: Callable[[], None] | None = None,
              wait_s: float = WAIT_S) -> int:
        """Copies a snapshot into the live objects; returns its step
        (``core.apply.apply_snapshot``: every check before the first byte, one copy of every
        tensor, then the host state). ``data``: a verified uint8 tensor or a storage's byte
        source (``storage.data_file.DataFile``); ``before_copy``: called after the checks,
        before the first byte (it may raise); ``wait_s``: the bound of a device copy's wait.
        The values saved with the step go into ``values``."""
        step, self.values = apply_mod.apply_snapshot(self, tensors, host, data, where,
                                                     before_copy, wait_s)
        return step
