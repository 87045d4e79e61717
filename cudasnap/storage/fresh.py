"""The fresh start's move (``fresh=True``, ``cudasnap run --fresh``): a local directory's
snapshots go aside, nothing is deleted. Local only: ``config.check_fresh_url`` refuses a
fresh start on an object-store URL."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from .._native import native
from ..format import paths
from . import posix

log = logging.getLogger("cudasnap")


def move_aside(directory: Path, arena: Any, threads: int, subdir: str | None = None) -> Path | None:
    """``fresh=True``: moves committed snapshots (and the arena's newest one) aside.

    Nothing is deleted: step directories, ``latest`` and the flush log go to
    ``DIR/.old-<UTC time>/``, and the newest COMPLETE snapshot of a leftover
    arena is written there too when no step directory holds it. The caller
    removes the arena afterwards. Returns the folder, or None when there was
    nothing to move. Several ranks may do this at once on one directory: each
    moves what is still there (``subdir``: where this rank's arena snapshot goes).
    """
    directory = Path(directory)
    snaps = posix.list_snapshots(directory)
    extras = [directory / n for n in (paths.LATEST, paths.FLUSH_LOG, "dist-log.jsonl")
              if (directory / n).exists()]
    slot = arena.newest_complete() if arena is not None else -1
    if not snaps and not extras and slot < 0:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    old = directory / f".old-{stamp}"
    n = 0
    while True:
        try:
            old.mkdir(mode=0o700)
            break
        except FileExistsError:
            n += 1
            old = directory / f".old-{stamp}-{n}"
    for p in [s.path for s in snaps] + extras:
        try:
            os.rename(p, old / p.name)
        except FileNotFoundError:  # another rank moved it first
            pass
    what = [f"{len(snaps)} snapshot(s)"]
    if slot >= 0:
        step = int(arena.slot_info(slot)["step"])
        if not (old / paths.step_dirname(step) / (subdir or "")).exists():
            arena.lease(slot)
            try:
                posix.write_slot(arena, slot, old, threads=threads, keep=0, subdir=subdir,
                                 update_latest=subdir is None)
            finally:
                arena.release(slot)
            what.append(f"step {step} from {arena.path}")
    native().fsync_dir(str(directory))
    log.warning("fresh start: moved %s aside to %s (nothing deleted); starting at step 0",
                " and ".join(what), old)
    return old
