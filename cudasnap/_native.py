"""Lazy access to the compiled engine ``cudasnap._C``.

``import cudasnap`` must stay cheap and must never touch CUDA, so the
extension is loaded on first use (after torch, whose libraries it links).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_C: ModuleType | None = None


def native() -> Any:
    """Returns the loaded ``cudasnap._C`` module (loading torch first)."""
    global _C
    if _C is None:
        import torch  # noqa: F401  (loads libc10 and the CUDA runtime _C links against)

        from .errors import SnapshotError

        try:
            _C = importlib.import_module("cudasnap._C")
        except ImportError as e:  # pragma: no cover - a broken install
            raise SnapshotError(
                f"cudasnap's compiled engine is missing or broken ({e}); "
                "build it with `make build` or `pip install --no-build-isolation -e .`") from e
    return _C
