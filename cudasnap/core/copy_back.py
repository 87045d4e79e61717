"""Copy-back of a verified snapshot into live tensors (restore, rollback).

``copy_into(pairs, data)`` does ``dst.copy_(src)`` for every (live tensor,
snapshot view) pair, with the same bytes as a result. The pairs that are plain
byte copies (a contiguous CPU destination, a contiguous source inside the
snapshot buffer ``data``, same dtype and shape, no destination overlapping
another) go to the engine's multi-threaded ``copy_spans`` in one call, first,
with the GIL released; torch's ``copy_`` keeps everything else (CUDA
destinations, non-contiguous ones, tensor subclasses, dtype views), in order.
The native call checks every span lies inside ``data`` before writing a byte.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..format.manifest import span_bytes

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def copy_threads() -> int:
    """Threads for copy-back: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _extent(t: Any, span: tuple[int, int, int] | None) -> tuple[int, int] | None:
    """[lo, hi) bytes a plain strided CPU tensor covers (its byte span, when it has one),
    None for any other."""
    if span is not None:
        return span[0], span[0] + span[2]
    if type(t) not in _PLAIN or not t.is_cpu or t.layout != torch.strided:
        return None
    n = span_bytes(list(t.shape), list(t.stride()), t.element_size())
    return (t.data_ptr(), t.data_ptr() + n) if n else None


def _overlapping(pairs: list[tuple[Any, Any]],
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


def byte_span(dst: Any, src: Any, lo: int, hi: int) -> tuple[int, int, int] | None:
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


def copy_into(pairs: list[tuple[Any, Any]], data: torch.Tensor,
              threads: int | None = None) -> int:
    """``dst.copy_(src)`` for each pair (under no_grad); returns the bytes the native
    multi-threaded copy moved. A destination overlapping another one keeps torch's
    sequential copy_, so the outcome never depends on the order of the copies."""
    lo = data.data_ptr() if data.numel() else 0
    hi = lo + data.numel() * data.element_size()
    spans: list[tuple[int, int, int] | None] = [
        byte_span(d, s, lo, hi) if lo else None for d, s in pairs]
    for group in _overlapping(pairs, spans):
        for i in group:
            spans[i] = None
    fast = [s for s in spans if s is not None]
    moved = 0
    if fast:
        from .._native import native

        moved = native().copy_spans(lo, hi - lo, fast, threads or copy_threads())
        for (d, _), s in zip(pairs, spans):
            if s is not None:  # what copy_ does: autograd sees the in-place change
                torch.autograd.graph.increment_version(d)
    with torch.no_grad():
        for (d, s), sp in zip(pairs, spans):
            if sp is None:
                d.copy_(s)
    return moved
