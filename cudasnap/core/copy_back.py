"""Copy-back of a verified snapshot into live tensors (restore, rollback).

``copy_into(pairs, data)`` does ``dst.copy_(src)`` for every (live tensor,
snapshot value) pair, with the same bytes as a result. A snapshot value is a
tensor, or a (validated) manifest entry: the view ``entry_view(data, entry)``,
built only when torch has to copy it. The pairs that are plain byte copies (a
contiguous CPU destination, a contiguous source inside the snapshot buffer
``data``, same dtype and shape, no destination overlapping another) go to the
engine's multi-threaded ``copy_spans`` in one call, first, with the GIL
released; torch's ``copy_`` keeps everything else (CUDA destinations,
non-contiguous ones, tensor subclasses, dtype views), in order. The native call
checks every span lies inside ``data`` before writing a byte.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import cast

import torch

from ..format.manifest import TensorEntry, dtype_key, span_bytes, torch_dtype

_PLAIN = (torch.Tensor, torch.nn.Parameter)
Entry = TensorEntry  # a manifest tensor entry
# A snapshot value: a tensor, or the entry of one in the snapshot's buffer (a view made on demand).
Source = torch.Tensor | Entry
Pair = tuple[torch.Tensor, Source]  # (live tensor, snapshot value)


def entry_view(data: torch.Tensor, e: Entry) -> torch.Tensor:
    """The snapshot's tensor of entry ``e``: a view of the flat buffer ``data``."""
    off, n = e["offset"], e["nbytes"]
    dt = torch_dtype(e["dtype"])
    flat = data[off:off + n].view(dt) if n else torch.empty(0, dtype=dt)
    return flat.as_strided(e["shape"], e["stride"]) if n else flat.reshape(e["shape"])


def entry_span(dst: torch.Tensor, e: Entry, size: int, device: str = "cpu") -> tuple[int, int, int] | None:
    """``byte_span(dst, entry_view(data, e), ...)`` without building the view: (dst
    pointer, offset in data, bytes), or None when torch's copy_ must do it. ``e``'s
    stride must be ``dst``'s (a contiguous dst has a contiguous view then); ``dst`` must
    be on a ``device`` ("cpu"; "cuda": a device pointer, core.device_restore)."""
    if (type(dst) not in _PLAIN or dst.device.type != device or dst.layout != torch.strided
            or not dst.is_contiguous() or dst.is_inference() or dst.is_conj() or dst.is_neg()
            or dtype_key(dst.dtype) != e["dtype"] or list(dst.shape) != e["shape"]
            or list(dst.stride()) != e["stride"]):
        return None
    off, n = e["offset"], e["nbytes"]
    if n == 0 or n != dst.nbytes or off < 0 or off + n > size:
        return None
    return dst.data_ptr(), off, n


class Ref:
    """An optimizer state tensor of the snapshot, by its manifest entry (no view yet)."""

    __slots__ = ("e",)

    def __init__(self, e: Entry) -> None:
        self.e = e


def fits_in_place(have: object, v: object) -> bool:
    """Whether the live optimizer value ``have`` can take snapshot value ``v`` in place:
    a tensor of the same shape and dtype for a tensor, anything for a scalar."""
    if isinstance(v, Ref):
        return isinstance(have, torch.Tensor) and list(have.shape) == v.e["shape"] \
            and dtype_key(have.dtype) == v.e["dtype"]
    return not isinstance(v, torch.Tensor) or (
        isinstance(have, torch.Tensor) and have.shape == v.shape and have.dtype == v.dtype)


def contiguous_strides(shape: list[int]) -> list[int]:
    out = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = acc
        acc *= max(shape[i], 1)
    return out


def empty_like_entry(data: torch.Tensor, e: Entry) -> torch.Tensor:
    """``torch.empty_like(entry_view(data, e))``, without the view when the
    entry is contiguous (the common case)."""
    if e["nbytes"] and e["stride"] == contiguous_strides(e["shape"]):
        return torch.empty(e["shape"], dtype=torch_dtype(e["dtype"]), device=data.device)
    return torch.empty_like(entry_view(data, e))


def copy_threads() -> int:
    """Threads for copy-back: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _extent(t: torch.Tensor, span: tuple[int, int, int] | None) -> tuple[int, int] | None:
    """[lo, hi) bytes a plain strided CPU tensor covers (its byte span, when it has one),
    None for any other."""
    if span is not None:
        return span[0], span[0] + span[2]
    if type(t) not in _PLAIN or not t.is_cpu or t.layout != torch.strided:
        return None
    n = span_bytes(list(t.shape), list(t.stride()), t.element_size())
    return (t.data_ptr(), t.data_ptr() + n) if n else None


def _overlapping(pairs: list[Pair],
                 spans: list[tuple[int, int, int] | None]) -> list[list[int]]:
    """Groups (2 or more pair indices) whose destinations overlap one another."""
    ext = sorted((e[0], e[1], i) for i, e in enumerate(
        _extent(d, sp) for (d, _), sp in zip(pairs, spans)) if e)
    groups: list[list[int]] = []
    cur: list[int] = []
    end = 0
    for a, b, i in ext:
        if cur and a >= end:
            if len(cur) > 1:
                groups.append(cur)
            cur = []
        cur.append(i)
        end = max(end, b) if len(cur) > 1 else b
    if len(cur) > 1:
        groups.append(cur)
    return groups


def byte_span(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> tuple[int, int, int] | None:
    """(dst pointer, offset in data, bytes) when ``dst.copy_(src)`` is a byte copy out of
    the buffer at [lo, hi); None when torch's copy_ must do it."""
    if (type(dst) not in _PLAIN or type(src) is not torch.Tensor or not dst.is_cpu
            or not src.is_cpu or dst.layout != torch.strided or dst.dtype != src.dtype
            or dst.shape != src.shape or not dst.is_contiguous() or not src.is_contiguous()
            or dst.is_inference() or dst.is_conj() or dst.is_neg() or src.is_conj()
            or src.is_neg()):
        return None
    n = dst.nbytes
    s = src.data_ptr()
    if n == 0 or s < lo or s + n > hi:
        return None
    return dst.data_ptr(), s - lo, n


def _dtypes() -> dict[str, torch.dtype]:
    """{manifest dtype name: torch.dtype} for the native planner (made once)."""
    global _DTYPES
    if _DTYPES is None:
        from ..format.manifest import _ITEMSIZE

        _DTYPES = {n: getattr(torch, n) for n in _ITEMSIZE if hasattr(torch, n)}
    return _DTYPES


_DTYPES: dict[str, torch.dtype] | None = None


def plan_reference(pairs: list[Pair], data: torch.Tensor
                   ) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """The reference planner, in Python (the native ``copy_pairs`` follows its rules):
    (byte-copy spans, their pair indices, indices of the pairs left to torch copy_)."""
    lo = data.data_ptr() if data.numel() and data.is_cpu else 0
    hi = lo + data.numel() * data.element_size()
    spans: list[tuple[int, int, int] | None] = []
    for d, s in pairs:
        sp = entry_span(d, s, hi - lo) if lo and type(s) is dict else None
        if sp is None and lo:
            sp = byte_span(d, entry_view(data, s) if type(s) is dict else cast(torch.Tensor, s), lo, hi)
        spans.append(sp)
    for group in _overlapping(pairs, spans):
        for i in group:
            spans[i] = None
    fast = [i for i, sp in enumerate(spans) if sp is not None]
    return [sp for sp in spans if sp is not None], fast, [
        i for i, sp in enumerate(spans) if sp is None]


def copy_into(pairs: list[Pair], data: torch.Tensor,
              threads: int | None = None, *, reference: bool = False,
              before: Callable[[], None] | None = None) -> int:
    """``dst.copy_(src)`` for each pair (under no_grad; ``src``: a tensor or a manifest
    entry of ``data``, see the module doc); returns the bytes the native
    multi-threaded copy moved. A destination overlapping another one keeps torch's
    sequential copy_, so the outcome never depends on the order of the copies.

    The byte copies are planned natively (``_C.plan_pairs``: no Python call per
    tensor); ``reference=True`` plans them in Python (``plan_reference``) instead.
    The views torch copies from are built before any byte is copied, so an entry
    they cannot be made of raises with every destination untouched; ``before()``
    runs then too (restore waits there for its CRC32C check).
    """
    lo = data.data_ptr() if data.numel() and data.is_cpu else 0
    size = data.numel() * data.element_size()
    run: Callable[[int], int] | None = None
    slow: list[int] = list(range(len(pairs)))
    if lo and pairs:
        from .._native import native

        C = native()
        if reference:
            spans, fast, slow = plan_reference(pairs, data)

            def run_spans(n: int) -> int:
                moved = C.copy_spans(lo, size, spans, n) if spans else 0
                for i in fast:  # what copy_ does: autograd sees the in-place change
                    torch.autograd.graph.increment_version(pairs[i][0])
                return moved
            run = run_spans
        else:
            plan = C.plan_pairs([d for d, _ in pairs], [s for _, s in pairs], _dtypes(),
                                _PLAIN, torch.Tensor, lo, size)
            slow, run = plan.slow, plan.run
    rest = [(pairs[i][0], entry_view(data, s) if type(s) is dict else cast(torch.Tensor, s))
            for i in slow for s in (pairs[i][1],)]
    if before is not None:
        before()
    moved = run(threads or copy_threads()) if run is not None else 0
    with torch.no_grad():
        for d, s in rest:
            d.copy_(s)
    return moved


def ranges_read(rest: Sequence[tuple[torch.Tensor, Source]], lo: int, size: int) -> list[tuple[int, int, int]]:
    """The (dst pointer, file offset, bytes) spans that fill the bytes of the buffer at
    ``lo`` (``size`` bytes) which the sources of ``rest`` read: merged, so that no two
    overlap."""
    spans: list[tuple[int, int]] = []
    for _, s in rest:
        if not isinstance(s, torch.Tensor) or not s.is_cpu or s.layout != torch.strided:
            continue
        n = span_bytes(list(s.shape), list(s.stride()), s.element_size())
        off = s.data_ptr() - lo
        if n and 0 <= off and off + n <= size:
            spans.append((off, off + n))
    spans.sort()
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(lo + a, a, b - a) for a, b in merged]
