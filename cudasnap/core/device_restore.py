"""Restore from a snapshot file to the GPU through page-locked chunks (issue 34 item 5).

``core.apply`` picks this path (``apply.device_scatters``) when the live tensors are on one
CUDA device and nothing is sharded; ``copy_to_device`` plans the byte copies (contiguous
CUDA and CPU destinations) and reads the storage's byte source with them
(``file_copy.run_to_device``: ``_C.read_file_to_device``, ``csrc/cuda/device_sink.cpp``);
torch's ``copy_`` keeps the rest, from the bytes read into the stand-in buffer.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from . import copy_back, file_copy
from .copy_back import Pair

if TYPE_CHECKING:
    from .types import SnapshotFile


def _disjoint(spans: list[tuple[int, int, int]]) -> set[int]:
    """Indices of the spans whose destinations overlap another one's (tied tensors)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    bad: set[int] = set()
    for a, b in zip(order, order[1:]):
        if spans[b][0] < spans[a][0] + spans[a][2]:
            bad.update((a, b))
    return bad


def copy_to_device(pairs: list[Pair], data: torch.Tensor, file: SnapshotFile, device: int,
                    before: Callable[[], None] | None, wait_s: float) -> None:
    """``apply._copy_from_file`` for a state on a GPU (issue 34 item 5): one native call reads the
    file chunk by chunk into page-locked buffers, checks each chunk's CRC32C, then copies
    its bytes to the contiguous CUDA destinations (a DMA, overlapped with the next read)
    and to the contiguous CPU ones; the rest (views, dtype casts, tied destinations)
    read their bytes from ``data`` (read the same way, only those ranges) through torch's
    ``copy_``. A chunk failing its CRC32C raises CorruptSnapshot before any byte of it is
    copied; ``partly_applied`` says whether earlier ones were."""
    size = file.nbytes
    dev: list[tuple[int, int, int]] = []
    host: list[tuple[int, int, int]] = []
    moved: list[torch.Tensor] = []
    rest: list[Pair] = []
    dev_pairs: list[Pair] = []
    host_pairs: list[Pair] = []
    for d, s in pairs:
        if type(s) is dict:
            span = copy_back.entry_span(d, s, size, "cuda")
            if span is not None:
                dev.append(span)
                dev_pairs.append((d, s))
                continue
            span = copy_back.entry_span(d, s, size)
            if span is not None:
                host.append(span)
                host_pairs.append((d, s))
                continue
        rest.append((d, s))
    for spans, kept in ((dev, dev_pairs), (host, host_pairs)):
        for i in sorted(_disjoint(spans), reverse=True):  # tied: torch copies them
            rest.append(kept.pop(i))
            spans.pop(i)
        moved += [d for d, _ in kept]
    views = [(d, copy_back.entry_view(data, s) if type(s) is dict else cast(torch.Tensor, s))
             for d, s in rest]
    host += copy_back.ranges_read(views, data.data_ptr(), size)
    if before is not None:
        before()
    # The copies run on streams of their own: whatever is still queued for these tensors
    # (an init's kernels, the last optimizer step before a rollback) must land first, as
    # it would before torch's copy_ on the current stream.
    torch.cuda.synchronize(device)
    file_copy.run_to_device(file, dev, host, device, wait_s)
    for t in moved:  # changed in place behind autograd's back
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)
    with torch.no_grad():
        for d, v in views:
            d.copy_(v)
