"""The copy engine of one Snapshotter: CPU worker threads, or the CUDA backend's copy stream.

Call order: the facade makes a ``Backend`` at construction (nothing is started
then); ``Layouts.current()`` calls :meth:`Backend.ensure` with the live tensors at
the first layout build, which picks the engine ("auto": CUDA when state lives on a
GPU) and makes it; from then on the ``Copier`` submits to ``engine`` and the
``ArenaKeeper`` page-locks arenas through ``cuda`` (None on the CPU backend).
``close()`` calls :meth:`Backend.stop` last. No user keeps the engine: each reads
``engine`` (and ``cuda``) from here at each call, so the engine in use is the one held here.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from ..errors import ConfigError
from .live_tensor import LiveTensor, single_cuda_device

if TYPE_CHECKING:
    from .state import TrainingState

log = logging.getLogger("cudasnap")


class Backend:
    def __init__(self, requested: str, copy_threads: int, wait_timeout_s: float,
                 arena_path: Path, device_staging: int | str = 0) -> None:
        self.requested = requested  # "auto", "cpu" or "cuda" (the constructor's keyword)
        self.name: str | None = None  # what "auto" resolved to, from the first boundary on
        self.engine: Any = None
        self.cuda: Any = None  # cudasnap._cuda.CudaBackend on the CUDA backend
        self.copy_threads = copy_threads
        self.wait_timeout_s = wait_timeout_s
        self._arena_path = arena_path  # named in the log line only
        self.device_staging = device_staging  # bytes or "auto" (the CUDA backend's buffer)

    def ensure(self, tensors: list[LiveTensor]) -> None:
        """Makes the engine for ``tensors`` (once; a no-op afterwards)."""
        if self.engine is not None:
            return
        on_gpu = any(lt.tensor.is_cuda for lt in tensors)
        name = self.requested
        if name == "auto":
            name = "cuda" if on_gpu else "cpu"
        if name == "cpu" and on_gpu:
            raise ConfigError("backend='cpu' but some state lives on a CUDA device")
        if name == "cuda":
            from .._cuda import CudaBackend

            dev = single_cuda_device(tensors)
            self.cuda = CudaBackend(dev, crc_threads=self.copy_threads,
                                    wait_timeout_s=self.wait_timeout_s,
                                    device_staging=self.device_staging)
            self.engine = self.cuda.engine
        else:
            self.engine = native().CpuCopyEngine(self.copy_threads)
            self.engine.wait_timeout_s = self.wait_timeout_s
        self.name = name
        log.info("cudasnap: %s backend, %d copy threads, arena %s", name, self.copy_threads,
                 self._arena_path)

    def state_device(self, state: TrainingState) -> int | None:
        """CUDA device index an arena must be page-locked for (None: CPU backend)."""
        if self.requested == "cpu":
            return None
        tensors = state.live_tensors()
        if not any(lt.tensor.is_cuda for lt in tensors):
            return None
        return single_cuda_device(tensors).index

    def stats(self) -> dict[str, Any]:
        """``stats()``'s device-staging fields (snapshot-then-offload; zeros when off)."""
        c = self.cuda.stats() if self.cuda is not None else {}
        return {"device_staging_bytes": c.get("device_staging_bytes", 0),
                "last_staged_bytes": c.get("last_staged_bytes", 0),
                "device_staging_reason": c.get("device_staging_reason")}

    def hung(self) -> bool:
        """The CUDA engine declared the GPU hung (a DMA may still read the state)."""
        return self.cuda is not None and bool(self.cuda.engine.hung)

    def copy_stream_handle(self) -> int | None:
        return int(self.cuda.engine.copy_stream) if self.cuda is not None else None

    def stop(self) -> bool:
        """close(): stops the engine (bounded by ``wait_timeout_s``); True when no copy
        can still read the state (False: the GPU hung with a DMA queued)."""
        if self.cuda is not None:
            self.cuda.close(self.wait_timeout_s)
            return not self.cuda.engine.hung
        if self.engine is not None and not self.engine.shutdown(self.wait_timeout_s):
            # The workers are joined either way: an abandoned copy reads nothing more.
            log.error("close(): the running snapshot copy was abandoned after %.0f s",
                      self.wait_timeout_s)
        return True
