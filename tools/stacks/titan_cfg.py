"""The README's torchtitan integration as a config module: the llama3 debug model with
cudasnap as its checkpoint manager (``--module tools.stacks.titan_cfg --config
llama3_debugmodel_cudasnap``); torchtitan's own flags (``--checkpoint.interval N``: a
committed flush every N steps) apply as they are."""
from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel

from cudasnap.integrations.torchtitan import CudaSnapCheckpointManager


def llama3_debugmodel_cudasnap():  # type: ignore[no-untyped-def]
    cfg = llama3_debugmodel()
    cfg.checkpoint = CudaSnapCheckpointManager.Config(enable=True)
    return cfg
