"""The PendingBoundary: the newest boundary not copied while the live tensors still hold it.

A boundary is not always copied at once: zero-overhead mode (``snapshot_every=k``) skips
k-1 of k by design, a large state's first plan is built off the training thread, and
before the staging arena is ready there is nothing to copy into. Until the next write
of the state (an optimizer step, a buffer's forward, a fence, a load), the live tensors
ARE that step, so a flush, ``wait()`` or ``close()`` meanwhile copies them
(``Copier.copy_live``) and at most one step is lost.

The ``Copier`` owns the one ``PendingBoundary`` and is the only writer of its boundary; the
others use these operations, never its fields:

* :meth:`record` (the copier, at a boundary it does not copy) and :meth:`clear` (at one
  it copies, or once the copy of the live state is in);
* :meth:`mark_dirty` (every writer of the state, through ``Copier.fence``): the live
  tensors are no longer that boundary's; returns the event of a copy of them running,
  which the writer waits for;
* :meth:`claim` (``Copier.copy_live``): the boundary to copy, once, with the copy's event
  set while it runs; None when the state moved past it or another thread copies it;
* :meth:`pending` / :meth:`clean` / :meth:`unprotected_here`: what the early saver and the
  flusher ask before they copy or wait.

Order: :meth:`mark_dirty` sets ``dirty`` before it reads the running copy's event, and
:meth:`claim` sets the event before it reads ``dirty``: a writer either sees the copy
and waits for it, or the copy sees the write and does not start.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("cudasnap")


class PendingBoundary:
    def __init__(self) -> None:
        self._boundary: tuple[int, bytes] | None = None  # (step, manifest suffix)
        self._dirty = True  # a write of the state since that boundary
        self._copying: threading.Event | None = None  # set while claim()'s copy runs
        self._claims = threading.Lock()  # makes claim()'s check-and-set of _copying atomic
        self.deferred = False  # the boundary's plan was being built (not the cadence's skip)
        self._unprotected: int | None = None  # thread of a boundary skipped for want of an arena

    # ------------------------------------------------------------ the copier
    def boundary_starts(self) -> None:
        """A boundary: the live tensors hold its step until the next write. An earlier
        boundary not copied is dropped first (the tensors no longer hold it): a copy
        claimed between this and the boundary's own ``record`` must find nothing, never
        the older step's manifest over this step's tensors."""
        self._boundary = None
        self._dirty = False

    def record(self, step: int, suffix: bytes, *, deferred: bool = False,
               unprotected: bool = False) -> None:
        """The boundary of ``step`` was not copied; ``suffix``: its manifest's host part.
        ``deferred``: its plan was being built; ``unprotected``: no arena was ready."""
        self._boundary = (step, suffix)
        if deferred:
            self.deferred = True
        if unprotected:
            self._unprotected = threading.get_ident()

    def clear(self) -> None:
        """The boundary was copied (or is about to be replaced by a restore)."""
        self._boundary = None
        self.deferred = False

    # ---------------------------------------------------------- the writers
    def mark_dirty(self) -> threading.Event | None:
        """The caller is about to write the state; returns the event of a copy of the live
        state now running (the caller waits for it), else None."""
        self._dirty = True
        return self._copying

    # ------------------------------------------------------------ the copy
    @contextmanager
    def claim(self) -> Iterator[tuple[int, bytes] | None]:
        """The boundary to copy now, or None (none, another thread copies it, or the state
        moved past it: logged). While the block runs, writers of the state wait for it;
        :meth:`copied` clears it once the copy is COMPLETE."""
        ev = threading.Event()
        with self._claims:  # one claim at a time (a flush, the coordinator's settle, wait())
            live = self._boundary
            if live is None or self._copying is not None:
                live = None
            else:
                self._copying = ev  # before reading the flag; mark_dirty() sets it the other way
        if live is None:
            yield None
            return
        try:
            if self._dirty or self._boundary is not live:
                log.info("JIT flush: the state moved past step %d (optimizer step since); "
                         "flushing the newest copied snapshot", live[0])
                yield None
            else:
                yield live
        finally:
            self._copying = None
            ev.set()

    def copied(self, live: tuple[int, bytes]) -> None:
        """``live`` (from :meth:`claim`) is COMPLETE in a slot."""
        if self._boundary is live:
            self._boundary = None

    # -------------------------------------------------------------- asking
    def pending(self) -> tuple[int, bytes] | None:
        """The boundary not copied, dirty or not."""
        return self._boundary

    def clean(self) -> bool:
        """No write of the state since the last boundary."""
        return not self._dirty

    def unprotected_here(self) -> bool:
        """The last boundary skipped for want of an arena ran on the calling thread."""
        return self._unprotected == threading.get_ident()
