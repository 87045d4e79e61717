"""The reader of a ``cudasnap export --to dcp`` checkpoint: ``cudasnap.load_resharded``.

The export (cudasnap.tools.export_dcp) is written by DCP's own FileSystemWriter beside a
host sidecar (:data:`HOST_SIDECAR`: the step, the optimizer's param groups, as typed JSON);
:func:`load_resharded` loads it on any mesh or world size through DCP's resharding load,
then restores the optimizer's param groups. It lives here, below the facade that names it
(``cudasnap.__getattr__``), so no import runs up from the package root to ``tools/``.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import IncompatibleSnapshot
from ..format import codec

if TYPE_CHECKING:
    import torch

HOST_SIDECAR = "cudasnap_host.json"


def load_resharded(checkpoint: str | Path, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None = None) -> int:
    """Loads a ``cudasnap export --to dcp`` checkpoint into ``model`` (and ``optimizer``) on
    any mesh or world size (DCP reshards: call it on every rank); returns the step to
    resume at. RNG and ``extra`` state are per rank and not carried over."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    checkpoint = Path(checkpoint)
    side = codec.loads((checkpoint / HOST_SIDECAR).read_text(), str(checkpoint / HOST_SIDECAR))
    sd: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    params: list[torch.Tensor] = []
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
