"""The edges of an attempt: before the staging arena is ready, and the arena left at exit.

Before the arena is ready (issue 23 item 2). A large arena is made (or an inherited
one warmed) on a background thread from construction on (cudasnap.core.arena_prep);
boundaries until then are skipped. Each skipped boundary still records its host
state (``note_unprotected``), so that the live tensors, as long as no optimizer step
ran since, ARE that step. A flush (explicit, or a trigger's: SIGUSR1, SIGTERM, a
health event, the hang watchdog) or ``close()`` arriving meanwhile calls
:func:`before_flush` / :func:`at_close`: the arena is made (or adopted) right there,
synchronously (``arena_prep.ensure(sync=True)``: a set-up already at work is waited
for, one not started is cancelled), and the live state is copied into it (the JIT
live copy of zero-overhead mode, ``FlushMixin._copy_live``); the flush then writes it.
When the state has moved on (an optimizer step since the boundary), a trigger's
flush waits (bounded by its timeout) for the next boundary, which snapshots into the
arena now ready. At most one step is lost either way. ``close()`` with nothing of
the attempt saved says so in a WARNING (:func:`warn_if_nothing_saved`).

At exit (issue 23 item 6). The arena is kept on purpose when a script dies (or ends
without ``close()``, or with ``close(keep_arena=True)``): a restart of the job adopts
it and resumes at its newest step. Outside ``cudasnap run`` nobody else knows it is
there, holding its size in RAM until ``cudasnap gc``: :func:`_report_at_exit` logs one
line per arena this process leaves, naming it, its size, its newest step and
``cudasnap gc``; an arena left with no snapshot in it (nothing to resume from) is
removed instead.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from ..errors import SnapshotError
from . import arena_prep

log = logging.getLogger("cudasnap")


# ------------------------------------------------ before the arena is ready
def note_unprotected(snap: Any, step: int, suffix: bytes | list[bytes]) -> None:
    """Training thread, at a boundary skipped for want of an arena: remember its host
    state, so a flush before the next optimizer step can copy the live tensors as it."""
    snap._live = (step, suffix if isinstance(suffix, bytes) else b"".join(suffix))
    snap._early_thread = threading.get_ident()


def _needs_arena(snap: Any) -> bool:
    """The newest boundary is in no arena and a flush could not copy it now."""
    return snap._live is not None and (snap._arena is None or snap._prep.pending)


def save_now(snap: Any, timeout: float | None, why: str) -> bool:
    """Makes (or adopts) the arena on this thread and copies the live state of the newest
    boundary into it. True when that step is now COMPLETE in the arena."""
    live = snap._live
    if snap._early_saving or live is None or not _needs_arena(snap):
        return False
    lock = snap._arena_lock
    if not lock.acquire(timeout=snap.wait_timeout_s):
        log.error("cudasnap: %s before the staging arena was ready, and it stayed busy for "
                  "%.0f s: nothing snapshotted", why, snap.wait_timeout_s)
        return False
    snap._early_saving = True  # _retire_arena's flush re-enters flush(): not again
    try:
        # Lock order: _arena_lock, then _flush_lock (a background regrowth, waited for
        # inside ensure(), takes _flush_lock itself: it must not be held here yet).
        step, suffix = live
        try:
            lay = snap._current_layout()
            arena = arena_prep.ensure(snap, lay.plan, lay.prefix_len + len(suffix), step,
                                      sync=True)
        except SnapshotError as e:
            log.error("cudasnap: %s before the staging arena was ready, and it could not be "
                      "made now: %s", why, e)
            return False
        if arena is None:
            return False
        if snap._live is not live or snap._live_dirty:
            return False  # moved on meanwhile: the caller waits for the next boundary
        before = snap._stats.live_saves
        with snap._flush_lock:
            snap._copy_live(timeout)
        if snap._stats.live_saves == before:
            return False
        snap._stats.early_saves += 1
        log.warning("cudasnap: %s before the staging arena was ready: step %d snapshotted "
                    "synchronously from the live state", why, step)
        return True
    finally:
        snap._early_saving = False
        lock.release()


def before_flush(snap: Any, timeout: float | None) -> None:
    """``flush()``: the newest boundary was skipped (arena not ready): snapshot it now.

    The live state past that boundary (an optimizer step ran since): on another thread
    than the training loop's (a trigger), the arena is made and the next boundary,
    which snapshots into it, is waited for (up to ``timeout``), so the flush writes it;
    on the training thread itself the flush writes what there is (the arena is ready
    for the next boundaries)."""
    if snap._early_saving or not _needs_arena(snap) or \
            threading.current_thread() is snap._prep._thread:  # a regrowth's own flush
        return
    if save_now(snap, timeout, "flush requested"):
        return
    if snap._live is None or not snap._live_dirty or snap._arena is None \
            or threading.get_ident() == snap._early_thread:
        return
    _wait_next_boundary(snap, snap.wait_timeout_s if timeout is None else timeout)


def _wait_next_boundary(snap: Any, timeout: float) -> None:
    """Until a boundary after the one in ``snap._live`` ran (it snapshots into the arena
    now ready, or, skipped, leaves its live state to copy), bounded by ``timeout``."""
    step = snap._live[0]
    ev = threading.Event()
    snap._boundary_event = ev  # before the check below: no boundary slips between
    deadline = time.monotonic() + timeout
    try:
        log.warning("cudasnap: flush requested mid-step before the staging arena was ready: "
                    "waiting up to %.0f s for the boundary after step %d", timeout, step)
        while snap.last_step == step:
            left = deadline - time.monotonic()
            if left <= 0 or not ev.wait(left):
                log.error("cudasnap: no boundary within %.0f s: the flush writes no newer "
                          "step", timeout)
                return
            ev.clear()
        if _needs_arena(snap) and not snap._live_dirty:  # that boundary found no arena
            save_now(snap, timeout, "flush requested")
    finally:
        snap._boundary_event = None


def at_close(snap: Any, keep: bool) -> None:
    """``close()`` before the arena was ready: the newest boundary goes into an arena made
    now (flushed by close's final flush, or kept for a restart when ``keep``)."""
    if _needs_arena(snap) and not snap._live_dirty:
        save_now(snap, min(60.0, snap.wait_timeout_s), "close()" if not keep else
                 "close(keep_arena=True)")


def warn_if_nothing_saved(snap: Any) -> None:
    """``close()``: boundaries ran but none of them was saved anywhere: say so."""
    st = snap._stats
    if snap._boundaries and st.skipped_not_ready and not st.snapshots \
            and not st.live_saves:
        log.warning("cudasnap: close(): none of this run's %d boundaries (last step %s) was "
                    "saved: the staging arena was not ready yet (%d skipped) and the state had "
                    "moved past the last boundary; a restart resumes from the previous "
                    "snapshot, if any", snap._boundaries, snap.last_step,
                    st.skipped_not_ready)


# ------------------------------------------------------------ at exit
_left: dict[str, int] = {}  # arena path -> pid that adopted it (a fork copies this dict)
_left_lock = threading.Lock()


def left_at_exit(path: str) -> None:
    """An arena this process uses: named at exit if it is still there."""
    with _left_lock:
        _left[str(path)] = os.getpid()


@atexit.register
def _report_at_exit() -> None:
    with _left_lock:
        paths = [p for p, pid in _left.items() if pid == os.getpid()]
    for path in paths:
        try:
            report_left_arena(path)
        except Exception as e:  # never fail an exit over a report
            log.debug("cudasnap: could not check the arena %s at exit: %s", path, e)


def report_left_arena(path: str) -> str | None:
    """One WARNING line for an arena of this process still in /dev/shm (its path, size,
    newest step, ``cudasnap gc``); an empty one is removed. Returns the line."""
    if not os.path.exists(path):
        return None
    from .._native import native

    a = native().Arena.open(path, False, False)
    if a.owner_pid != os.getpid():
        return None  # another process adopted it: its business
    slot = a.newest_complete()
    size = a.total_bytes
    step = a.slot_info(slot)["step"] if slot >= 0 else None
    del a
    if step is None:
        os.unlink(path)
        log.info("cudasnap: removed the staging arena %s at exit: it held no snapshot", path)
        return None
    line = (f"cudasnap: the staging arena {path} ({size / 1e9:.2f} GB of shared memory, "
            f"newest snapshot: step {step}) stays in /dev/shm after this process, so a "
            f"restart of this job resumes from it; it holds that RAM until then: run "
            f"`cudasnap gc` to free it")
    log.warning(line)
    return line
