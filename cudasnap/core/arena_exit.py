"""The staging arena this process leaves in /dev/shm at exit (issue 23 item 6).

The arena is kept on purpose when a script dies (or ends
without ``close()``, or with ``close(keep_arena=True)``): a restart of the job adopts
it and resumes at its newest step. Outside ``cudasnap run`` nobody else knows it is
there, holding its size in RAM until ``cudasnap gc``: ``_report_at_exit`` logs one
line per arena this process leaves, naming it, its size, its newest step and
``cudasnap gc``; an arena left with no snapshot in it (nothing to resume from) is
removed instead.

Call order: the ``ArenaKeeper`` calls :func:`left_at_exit` for each arena it opens or
adopts (not under ``cudasnap run``, whose supervisor takes care of it); at exit,
:func:`report_left_arena` runs for each one still there.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading

log = logging.getLogger("cudasnap")


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
