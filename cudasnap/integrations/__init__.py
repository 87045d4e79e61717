"""Framework integrations of cudasnap (optional dependencies, imported on demand).

* :mod:`cudasnap.integrations.lightning` — ``CudaSnapCallback`` for PyTorch Lightning
  (package ``lightning``, or ``pytorch_lightning``), plus ``ResumableDataLoader``.
* :mod:`cudasnap.integrations.hf` — ``CudaSnapTrainerCallback`` for ``transformers.Trainer``.

Importing this package imports neither framework.
"""
from __future__ import annotations

from typing import Any

__all__ = ["CudaSnapCallback", "ResumableDataLoader", "CudaSnapTrainerCallback"]


def __getattr__(name: str) -> Any:
    if name in ("CudaSnapCallback", "ResumableDataLoader"):
        from . import lightning

        return getattr(lightning, name)
    if name == "CudaSnapTrainerCallback":
        from . import hf

        return hf.CudaSnapTrainerCallback
    raise AttributeError(f"module 'cudasnap.integrations' has no attribute {name!r}")
