"""The flush of a dead attempt's shared memory: the arenas' newest COMPLETE slots, to disk.

Owns: which slots a dead attempt left newer than disk (:func:`_orphan_slots`, which
leases them), writing the leased slots (:func:`_flush_leased`), and removing this
process's partial step directories (:func:`_remove_own_partial`).

Call order (cudasnap.supervisor.loop, after each death): ``_orphan_slots`` BEFORE the
restart (fast: arena headers only; the lease keeps the restarted process from reusing
a slot still to be written), then ``_flush_leased`` in a thread beside the restart;
``_remove_own_partial`` when the supervisor ends. :func:`flush_orphans` is both at once.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from ..errors import SnapshotError
from ..format import paths
from ..storage import posix

if TYPE_CHECKING:
    from ..storage.protocol import Storage

log = logging.getLogger("cudasnap.run")


def _orphan_slots(directory: Path, job: str, shm_dir: Path, remote: Storage | None = None
                  ) -> list[tuple[Path, Any, int, int]]:
    """(path, arena, slot, step) of each arena's newest COMPLETE slot newer than disk (or
    than the object store ``remote``), leased.

    Fast (no I/O but the arena headers): done before the restart, so that the
    restarted process cannot overwrite a slot that is still to be flushed.
    """
    C = native()
    out = []
    on_disk = {s.step for s in (remote.list_snapshots() if remote is not None
                                else posix.list_snapshots(directory))}
    for path in sorted(shm_dir.glob(paths.arena_glob(job))):
        try:
            arena = C.Arena.open(str(path), True)
        except SnapshotError as e:
            log.warning("cannot open arena %s: %s", path, e)
            continue
        slot = arena.newest_complete()
        if slot < 0:
            log.warning("arena %s holds no COMPLETE snapshot", path)
            continue
        step = arena.slot_info(slot)["step"]
        if step in on_disk:
            out.append((path, arena, -1, step))
            continue
        arena.lease(slot)
        out.append((path, arena, slot, step))
    return out


def _flush_leased(directory: Path, leased: list[tuple[Path, Any, int, int]],
                  threads: int = 4, remote: Storage | None = None) -> list[dict[str, Any]]:
    """Writes each leased slot (to the object store ``remote`` when given: uploaded, then
    committed, as a Snapshotter's flush); a failure (disk full, store unreachable) is
    logged and the arena kept."""
    done: list[dict[str, Any]] = []
    for path, arena, slot, step in leased:
        if slot < 0:
            done.append({"arena": str(path), "step": step, "seconds": 0.0, "skipped": True})
            continue
        t0 = time.perf_counter()
        try:
            target: Path | str
            if remote is not None:
                target, st = remote.write_slot(arena, slot, threads=threads)
            else:
                target, st = posix.write_slot(arena, slot, directory, threads=threads)
            done.append({"arena": str(path), "step": step, "seconds": time.perf_counter() - t0,
                         "bytes": st["bytes"], "path": str(target)})
            log.warning("flushed step %d left in %s to %s (%.2f s)", step, path, target,
                        time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - any failure: logged, the arena kept
            log.error("could not flush step %d left in %s: %s; the arena is kept (a restarted "
                      "job restores from it)", step, path, e)
            done.append({"arena": str(path), "step": step, "error": str(e),
                         "seconds": time.perf_counter() - t0})
            _remove_own_partial(directory, step)
        finally:
            arena.release(slot)
    return done


def _remove_own_partial(directory: Path, step: int | None = None) -> None:
    """Removes this process's ``step-N.tmp-<pid>`` directories (a flush that failed or
    was cut short); ``step`` None: every step's."""
    name = paths.step_dirname(step) if step is not None else "step-*"
    for p in [*Path(directory).glob(f"{name}.tmp-{os.getpid()}"),
              *Path(directory).glob(f"{name}/*.tmp-{os.getpid()}")]:
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            log.warning("removed %s, left by an interrupted flush of this supervisor", p)


def flush_orphans(directory: Path, job: str, shm_dir: Path, threads: int = 4) -> list[dict[str, Any]]:
    """Flushes every COMPLETE slot of ``job``'s arenas that is newer than disk."""
    return _flush_leased(directory, _orphan_slots(directory, job, shm_dir), threads)
