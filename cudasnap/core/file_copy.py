"""The restore's reads of a snapshot file: core reads the storage's byte source itself.

The storage opens and checks a local snapshot's data.bin and hands the restore a record
of it (``storage.data_file.DataFile``: descriptor, path, size, chunk size, the manifest's
CRC32C list, the read-ahead of its head, the read settings; ``core.types.SnapshotFile``),
holding no copy logic. ``core.apply`` and ``core.device_restore`` plan the copies; the
functions here run them (one native call each, GIL released): every chunk is read into a
small buffer and its CRC32C checked before any byte of it is copied.

* ``read_whole``: the whole file into a new buffer (a destination torch must copy to);
* ``run_plan``: ``RestorePlan.run_file``, the planned copies to CPU tensors;
* ``run_to_device``: ``_C.read_file_to_device``, to one CUDA device through page-locked
  buffers (and the CPU tensors beside it).

Each stops the read-ahead and frees its buffer once read, however the read ends
(``DataFile.stop_ahead``). A chunk failing its CRC32C raises CorruptSnapshot before any
byte of it is copied, with ``partly_applied`` set to whether chunks verified before it were
copied already (the live tensors then hold parts of two snapshots: the caller must restore
another one in full, or say so; ``core.restore.Restorer._apply`` records it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._native import native
from ..errors import SnapshotError

if TYPE_CHECKING:
    from cudasnap._C import RestorePlan, ScatterStats

    from .types import SnapshotFile


def read_whole(src: SnapshotFile) -> torch.Tensor:
    """The whole file in a new uint8 tensor, every chunk CRC32C-verified before any byte
    of it is copied there (read from the open file, the head from the read-ahead)."""
    buf = torch.empty(src.nbytes, dtype=torch.uint8)
    try:
        native().read_file_scatter(src.fd, str(src.path), src.nbytes, src.chunk_bytes,
                                   src.crcs, [(buf.data_ptr(), 0, src.nbytes)],
                                   src.threads, src.io_bytes, src.direct, src.ahead)
    finally:
        src.stop_ahead()
    return buf


def run_plan(src: SnapshotFile, plan: RestorePlan, extra: list[tuple[int, int, int]]
             ) -> ScatterStats:
    """``plan.run_file`` on the file: the planned copies (``plan_pairs`` against a buffer
    of the file's size standing for it) and the ``extra`` (dst pointer, file offset, bytes)
    spans, each chunk verified before any byte of it is copied; ``partly_applied`` on a
    CorruptSnapshot as the module says."""
    try:
        return plan.run_file(src.fd, str(src.path), src.nbytes, src.chunk_bytes, src.crcs,
                             extra, src.threads, src.io_bytes, src.direct, src.ahead)
    except SnapshotError as e:
        e.partly_applied = plan.applied > 0  # type: ignore[attr-defined]
        raise
    finally:
        src.stop_ahead()


def run_to_device(src: SnapshotFile, device_spans: list[tuple[int, int, int]],
                  host_spans: list[tuple[int, int, int]], device: int, wait_s: float
                  ) -> dict[str, Any]:
    """Reads the file chunk by chunk into page-locked buffers, each chunk verified before
    any byte of it is copied: to ``device_spans`` (device pointer, file offset, bytes) on
    cuda:``device`` by DMA, overlapped with the next read, and to ``host_spans`` by memcpy
    (``_C.read_file_to_device``); ``partly_applied`` on a CorruptSnapshot as the module
    says. ``wait_s``: the bound of a copy's wait (``Options.waits.copy_s``)."""
    progress: dict[str, int] = {}
    try:
        return native().read_file_to_device(
            src.fd, str(src.path), src.nbytes, src.chunk_bytes, src.crcs, host_spans,
            device_spans, device, src.threads, src.io_bytes, src.direct,
            src.ahead, wait_s, progress)
    except SnapshotError as e:
        e.partly_applied = progress.get("applied", 0) > 0  # type: ignore[attr-defined]
        raise
    finally:
        src.stop_ahead()
