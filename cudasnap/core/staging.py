"""Staging: the shared-memory arena a snapshot is copied into (adopt, create, retire).

One arena per rank, named by ``cudasnap.format.paths.arena_path``. A process
finds the arena its predecessor left (``_open_inherited_arena``), adopts it or
makes a new one when the state first needs one (small arenas here, large ones in
the background: ``cudasnap.core.arena_prep``), and replaces it when the state
grows (``_retire_arena``: the old one's newest snapshot goes to disk first).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from .._native import native
from .._proc import pid_alive
from ..errors import ConfigError, SnapshotError
from ..format import paths
from ..storage import posix
from . import arena_prep, early
from .live_tensor import single_cuda_device
from .shared import Fields
from .timeline import arena_slots, move_aside

log = logging.getLogger("cudasnap")


def supervisor_job(env_job: str | None, sup_dir: str | None, supervised: bool,
                   directory: Path) -> str | None:
    """The job id ``cudasnap run`` exported, when it names this directory's arena."""
    if env_job and sup_dir and supervised and \
            os.path.realpath(sup_dir) != os.path.realpath(directory):
        # The supervisor flushes and restarts for its --dir; this Snapshotter writes elsewhere.
        log.warning("cudasnap run --dir %s, but this Snapshotter's directory is %s: the "
                    "supervisor's flush after a crash goes to its own directory and the "
                    "restart restores from %s; pass the same directory to both", sup_dir,
                    directory, directory)
        return None  # its job id names the supervisor directory's arena, not this one's
    return env_job


class StagingMixin(Fields):
    def staged_arenas(self) -> list[Any]:
        """This rank's open arenas: its own, then one inherited from a predecessor."""
        return [a for a in (self._arena, self._inherited) if a is not None]

    def _start_fresh(self) -> None:
        """``fresh=True``: snapshots (and the inherited arena's newest) go aside, then the
        inherited arena is removed (cudasnap.core.timeline.move_aside)."""
        move_aside(self.directory, self._inherited, self.flush_threads,
                   None if self.world_size == 1 else paths.rank_dirname(self.rank))
        if self._inherited is not None:
            self._inherited.unlink()
            self._inherited = None

    def _staging_stats(self) -> dict[str, Any]:
        """``stats()``'s arena fields: where it lives, how it is pinned, its slots."""
        arenas = self.staged_arenas()
        a = arenas[0] if arenas else None
        s: dict[str, Any] = {"staging": None if a is None else {
            "path": a.path, "bytes": a.total_bytes, "shared": a.shared,
            "page_locked": a.cuda_registered, "huge_pages": a.huge_pages,
            # Why the arena is process-private (cudaHostRegister of the shared file refused).
            "fallback_reason": self._prep.fallback_reason or (
                self._cuda.fallback_reason if self._cuda is not None else None)}}
        s["arena_preparing"] = self._prep.pending
        s.update(arena_slots(a, self.num_slots, self.spare_slot))
        return s

    def _release_arenas(self, unlink: bool) -> None:
        """close(): drops the arenas, removing their files unless ``unlink`` is False."""
        for a in self.staged_arenas():
            if unlink:
                a.unlink()
        self._arena = self._inherited = None

    def arena_ready(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout`` s) for a background arena set-up; True when none runs.

        The next boundary then adopts the arena and snapshots again.
        """
        return self._prep.wait(timeout)

    def _state_device(self) -> int | None:
        """CUDA device index the arena must be page-locked for (None: CPU backend)."""
        if self._backend_name == "cpu":
            return None
        tensors = self.state.live_tensors()
        if not any(lt.tensor.is_cuda for lt in tensors):
            return None
        return single_cuda_device(tensors).index

    def _open_inherited_arena(self) -> None:
        if not self.arena_path.exists():
            return
        C = native()
        try:  # pre-faulted by arena_prep.start_at_construction (large: in the background)
            arena = C.Arena.open(str(self.arena_path), True, False)
        except SnapshotError as e:
            log.warning("ignoring unreadable staging arena %s: %s", self.arena_path, e)
            self.arena_path.unlink(missing_ok=True)
            return
        owner = arena.owner_pid
        if owner != os.getpid() and pid_alive(owner):
            raise ConfigError(f"staging arena {self.arena_path} belongs to running process {owner}")
        arena.claim_owner()  # from now on `cudasnap gc` sees this process as the user
        if not self._supervised:
            early.left_at_exit(arena.path)  # named at exit if still there (issue 23 item 6)
        self._inherited = arena
        slot = arena.newest_complete()
        if slot >= 0:
            info = arena.slot_info(slot)
            log.info("found snapshot of step %d in shared memory (%s), left by pid %d",
                     info["step"], self.arena_path, info["writer_pid"])

    def _ensure_arena(self, plan: Any, meta_len: int) -> Any:
        """The arena for ``plan``, or None (this boundary is skipped; see arena_prep)."""
        return arena_prep.ensure(self, plan, meta_len, int(self.last_step or 0))

    def _make_arena_here(self, regrow: bool, capacity: int, meta_capacity: int,
                         prefault: bool = True) -> Any:
        """An arena made on the calling thread: a small one at a boundary, or any size for
        a synchronous snapshot before the background one was ready (cudasnap.core.early;
        ``prefault`` False: reserved, its pages mapped by the copies that write them)."""
        if regrow:
            log.warning("state grew; re-creating the staging arena")
            if not self._retire_arena():
                return None
        if self._inherited is not None:
            arena_prep.drop(self._inherited)
            self._inherited = None
        t0 = time.perf_counter()
        self.arena_path.unlink(missing_ok=True)
        arena = self._create_arena(capacity, meta_capacity) if prefault else \
            self._create_arena(capacity, meta_capacity, None, False)
        self._arena = self._adopt(arena)
        self._stats.arena_setup_seconds = time.perf_counter() - t0
        log.info("staging arena %s: %d slots x %.1f MB, set up in %.2f s", self.arena_path,
                 self.num_slots, capacity / 1e6, self._stats.arena_setup_seconds)
        return self._arena

    def _create_arena(self, capacity: int, meta_capacity: int, cancel: Any = None,
                      prefault: bool = True) -> Any:
        return native().Arena.create(str(self.arena_path), self.num_slots, capacity,
                                     meta_capacity, self.chunk_bytes, self.job, prefault, cancel)

    def _retire_arena(self) -> bool:
        """Frees the current arena before a bigger one is made, keeping its snapshot.

        /dev/shm must hold only one arena at a time, so the old one is released
        (unregistered, unlinked, unmapped) first. Its newest COMPLETE snapshot
        is written to disk beforehand unless the disk already has that step: a
        crash before the new arena holds a COMPLETE snapshot then still finds
        it. False (the boundary is skipped) while a copy into it still runs.
        """
        if not self._wait_job(self.wait_timeout_s):
            log.warning("staging arena not re-created: a copy into the old one is still running")
            return False
        old = self._arena
        slot = old.newest_complete()
        if slot >= 0:
            step = old.slot_info(slot)["step"]
            if self.dist is not None:
                log.warning("state grew: the in-memory snapshot of step %d is dropped with the "
                            "old staging arena (multi-rank flushes are coordinated; flush "
                            "before the state grows to keep it)", step)
            elif not any(s.step == step for s in posix.list_snapshots(self.directory)):
                log.warning("state grew: writing the snapshot of step %d to disk before its "
                            "staging arena is replaced", step)
                self.flush(wait=False)
        if self._cuda is not None and not self._cuda.release_arena(old, self.wait_timeout_s):
            return False
        with self._flush_lock:  # may run on the arena preparer: never under a flush
            old.unlink()
            self._arena = old = None  # drops the mapping (the engine holds none once idle)
        self._stats.arena_regrowths += 1
        return True

    def _adopt(self, arena: Any) -> Any:
        if arena.writable:
            arena.claim_owner()  # `cudasnap gc` must see this process as the live user
        if arena.shared and not self._supervised:
            early.left_at_exit(arena.path)  # named at exit if still there (issue 23 item 6)
        if self._cuda is not None:
            return self._cuda.prepare_arena(arena, self, self._prep.fallback_reason)
        return arena
