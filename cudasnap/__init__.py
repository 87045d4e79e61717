"""cudasnap: just-in-time checkpointing for PyTorch training.

A failure costs one minibatch: the state is copied into shared-memory staging
at every iteration boundary (in the background), and written to disk just in
time when a health signal, a signal or a crash says the job is going down.

``import cudasnap`` is cheap and never touches CUDA; the compiled engine loads
on first use.
"""
from __future__ import annotations

from typing import Any

from .errors import (
    ConfigError,
    CorruptSnapshot,
    CudaError,
    FlushError,
    IncompatibleSnapshot,
    SnapshotError,
    StagingError,
)

__version__ = "0.1.0"


def build_info() -> dict[str, Any]:
    """Version, torch version (the one built against, which is the running one:
    loading refuses another), compiled backends, CUDA version and architectures."""
    import torch

    from ._native import native

    info: dict[str, Any] = dict(native().BUILD_INFO)
    info["torch_built_against"] = info["torch"]
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["backends"] = list(info["backends"])
    return info


def __getattr__(name: str) -> Any:
    if name == "Snapshotter":
        from .snapshotter import Snapshotter

        return Snapshotter
    if name == "run_inprocess":  # in-process restart: survivors keep their process
        from .distributed.inprocess import run_inprocess

        return run_inprocess
    if name == "load_resharded":  # a cudasnap export --to dcp checkpoint, any mesh
        from .core.dcp_load import load_resharded

        return load_resharded
    raise AttributeError(f"module 'cudasnap' has no attribute {name!r}")


__all__ = ["Snapshotter", "load_resharded", "run_inprocess", "build_info", "SnapshotError", "CorruptSnapshot",
           "IncompatibleSnapshot", "StagingError", "FlushError", "CudaError", "ConfigError",
           "__version__"]
