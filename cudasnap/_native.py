"""Lazy access to the compiled engine ``cudasnap._C``.

``import cudasnap`` must stay cheap and must never touch CUDA, so the
extension is loaded on first use (after torch, whose libraries it links).

The extension links torch's C++ libraries, whose ABI changes between releases,
so it only works under the torch it was built against. That version is compiled
into the library twice: in ``BUILD_INFO["torch"]`` and as a plain marker string
(``cudasnap-built-with-torch:<version>``) that can be read from the file when the
library cannot even be loaded (undefined symbols under another torch). Either
way a mismatch raises ``SnapshotError`` naming both versions.
``CUDASNAP_ALLOW_TORCH_MISMATCH=1`` (a cudasnap.config boolean) downgrades a loadable
mismatch to a warning.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import cudasnap._C as _C_stub
    from cudasnap._C import NativeModule

    _module_is_native: NativeModule = _C_stub  # the stub's module satisfies its protocol

from .config import allowed

log = logging.getLogger("cudasnap")
_C: ModuleType | None = None
MARKER = b"cudasnap-built-with-torch:"
REBUILD_HINT = ("rebuild cudasnap against the installed torch: `pip install --no-build-isolation "
                "--force-reinstall --no-deps <cudasnap source>` (or `make build` in a checkout)")


def torch_mismatch_message(built: str | None, running: str, library: str | None) -> str:
    """The error for an extension built against another torch than the running one."""
    where = f" ({library})" if library else ""
    built_s = built or "an unknown torch release"
    return (f"cudasnap's compiled engine{where} was built against torch {built_s}, but this process "
            f"runs torch {running}; the extension only works with the torch it was built against: "
            f"{REBUILD_HINT}")


def built_torch_version(library: str | Path) -> str | None:
    """Reads the torch version compiled into ``library`` without loading it."""
    try:
        data = Path(library).read_bytes()
    except OSError:
        return None
    i = data.find(MARKER)
    if i < 0:
        return None
    m = re.match(rb"[0-9A-Za-z.+_-]+", data[i + len(MARKER): i + len(MARKER) + 64])
    return m.group(0).decode() if m else None


def _library_path() -> str | None:
    try:
        spec = importlib.util.find_spec("cudasnap._C")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def native() -> NativeModule:
    """Returns the loaded ``cudasnap._C`` module (loading torch first)."""
    global _C
    if _C is None:
        import torch  # (loads libc10 and the CUDA runtime _C links against)

        from .errors import SnapshotError

        running = str(torch.__version__)
        try:
            mod = importlib.import_module("cudasnap._C")
        except ImportError as e:
            lib = _library_path()
            built = built_torch_version(lib) if lib else None
            if built is not None and built != running:
                raise SnapshotError(torch_mismatch_message(built, running, lib) + f" [load error: {e}]") from e
            raise SnapshotError(
                f"cudasnap's compiled engine is missing or broken ({e}); "
                "build it with `make build` or `pip install --no-build-isolation .`") from e
        built = mod.BUILD_INFO.get("torch")
        if built != running:
            msg = torch_mismatch_message(built, running, getattr(mod, "__file__", None))
            if not allowed("CUDASNAP_ALLOW_TORCH_MISMATCH"):
                raise SnapshotError(msg + " (set CUDASNAP_ALLOW_TORCH_MISMATCH=1 to try anyway)")
            log.warning("%s (continuing: CUDASNAP_ALLOW_TORCH_MISMATCH=1)", msg)
        _C = mod
    return _C
