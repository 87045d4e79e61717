"""A test's reach into the components a ``Snapshotter`` owns (``cudasnap/core/wiring.py``).

The facade keeps no views of its components' state for tests; a test that must see (or
stall) one part goes through these, so what the tests reach is written in one place:

- ``arena(snap)``: ``snap._keeper.arena``, this rank's staging arena (None before one exists)
- ``prep(snap)``: ``snap._keeper.prep``, the background arena set-up (``ArenaPreparer``)
- ``cuda(snap)``: ``snap._backend.cuda``, the ``CudaBackend`` (None on the CPU backend)
- ``engine(snap)``: ``snap._backend.engine``, the copy engine
- ``job(snap)``: ``snap._copier.job``, the running copy (None: none)
- ``layout(snap)``: ``snap._layouts.layout``, the current ``Layout`` (None: to be rebuilt)
- ``partly_applied(snap)``: ``snap._restorer.partly_applied``, a snapshot a restore left
  half-applied (None: none)
- ``set_rescan_every(snap, n)``: ``snap._layouts.rescan_every = n``
- ``swap_engine(snap, new)``: ``new`` in place of the engine (the ``Backend``'s and the
  ``CudaBackend``'s); returns the one it replaced

Prefer the public API where it says the same thing (``snap.staged_arenas()``,
``snap.stats()``, ``snap.copy_stream_handle()``).
"""
from __future__ import annotations

from typing import Any


def arena(snap: Any) -> Any:
    """The arena the copies go to (None before the first boundary made it)."""
    return snap._keeper.arena


def prep(snap: Any) -> Any:
    """The background arena set-up (``cudasnap.core.arena_preparer.ArenaPreparer``)."""
    return snap._keeper.prep


def cuda(snap: Any) -> Any:
    """The ``CudaBackend`` (None on the CPU backend and before the first boundary)."""
    return snap._backend.cuda


def engine(snap: Any) -> Any:
    """The copy engine (None before the first boundary)."""
    return snap._backend.engine


def job(snap: Any) -> Any:
    """The running copy job (None: none submitted, or forgotten after a wait)."""
    return snap._copier.job


def layout(snap: Any) -> Any:
    """The current ``Layout`` (None: rebuilt at the next boundary)."""
    return snap._layouts.layout


def partly_applied(snap: Any) -> str | None:
    """The snapshot a restore failed half-way through (None: none)."""
    return snap._restorer.partly_applied


def set_rescan_every(snap: Any, n: int) -> None:
    """A full re-scan of the state every ``n`` x ceil(tensors / 1024) boundaries."""
    snap._layouts.rescan_every = n


def swap_engine(snap: Any, new: Any) -> Any:
    """Puts ``new`` in place of the copy engine (after the first boundary made one); returns
    the engine it replaced. The Copier, the keeper and the layouts read the engine from the
    ``Backend`` at each call, so the next boundary submits to ``new``; on the CUDA backend
    the ``CudaBackend`` holds it too and is changed alike."""
    b = snap._backend
    old = b.engine
    b.engine = new
    if b.cuda is not None:
        b.cuda.engine = new
    return old
