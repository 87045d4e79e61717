"""The Snapshotter: snapshot at every iteration boundary, flush just in time, restore.

Typical use: README.md "Quick start".

``boundary(step)`` captures host state, then hands a cached copy plan to the
copy engine and returns. The next ``optimizer.step()`` (a step pre-hook) and
the next forward of a module owning buffers (a forward pre-hook) wait for the
running copy, so no snapshot ever mixes two steps. ``flush()`` writes the
newest COMPLETE snapshot to disk; the health monitor and signal handlers call
it on a bad sign.

This module only wires the parts; each mechanism lives in ``cudasnap.core``:
``fences`` (hooks ordering writes after the copy), ``layout`` (the plan cache),
``staging`` (the shared-memory arena), ``submit`` (boundary -> copy engine),
``flush``, ``restore`` (candidates, load, rollback), ``timeline`` (step rule,
resume, fresh start) and ``state`` (what is snapshotted).
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import Settings
from .core import arena_prep, early, vml_warmup
from .core.counters import Counters
from .core.fences import FencesMixin
from .core.flush import FlushMixin
from .core.layout import LayoutMixin
from .core.restore import RestoreMixin
from .core.shared import RNG_SOURCES, check_options, check_url
from .core.staging import StagingMixin, supervisor_job
from .core.state import TrainingState
from .core.submit import SubmitMixin
from .core.timeline import final_flush
from .errors import SnapshotError
from .format import paths
from .storage import open_storage, posix

log = logging.getLogger("cudasnap")

DEFAULT_CHUNK = 4 << 20


class Snapshotter(FencesMixin, LayoutMixin, StagingMixin, SubmitMixin, FlushMixin, RestoreMixin):
    """Just-in-time snapshots of a model, its optimizer and extra host state.

    Args:
        model: a ``torch.nn.Module`` or a dict of them (names prefix tensor names).
        optimizer: a ``torch.optim.Optimizer``, a dict of them, or None.
        directory: where flushed snapshots go (created 0700; checked writable now);
            default: $CUDASNAP_DIR (set by ``cudasnap run``) or ./ckpt. An fsspec URL
            (``s3://bucket/prefix``) stores snapshots in an object store, single-rank,
            one writer per URL (see cudasnap.storage.fsspec).
        extra: objects with ``state_dict``/``load_state_dict`` (schedulers, samplers,
            data-position objects) or ``torch.Generator``s; saved as JSON at each boundary.
        num_slots: shared-memory slots (>= 2): one COMPLETE while the next is WRITING.
        spare_slot: one more slot in the arena (default on), so a flush, which holds
            the slot it writes for its whole duration, never stops the snapshots: the
            newest step stays in shared memory (replay <= 1 step after a death during
            or right after a flush). Costs one slot of /dev/shm (about the state's
            bytes; ``stats()["spare_slot_bytes"]``). Off: boundaries during a flush
            are skipped once the other slot holds the newest step.
        flush_on_close: ``close()`` flushes the newest snapshot (unless that step is
            already on disk) before removing the arena, so a restart after a clean
            end resumes from disk at the last step. Not with ``close(keep_arena=True)``
            (the arena keeps the state) nor in distributed mode (a coordinated flush
            needs every rank: call ``flush()`` on every rank before ``close()``).
        fresh: start over: committed snapshots, ``latest`` and the flush log are
            moved aside to ``DIR/.old-<UTC time>/`` (with the newest snapshot of a
            leftover arena written there too; nothing is deleted), the arena is
            removed, and ``restore_latest()`` returns 0. Default: CUDASNAP_FRESH=1
            (set by ``cudasnap run --fresh``). Without it, a resume is logged at
            WARNING once, naming the step and where it comes from.
        backend: "auto" (CUDA when state lives on a GPU), "cpu" or "cuda".
        copy_threads / flush_threads: worker threads of the copy engine / flusher.
        keep: committed snapshots kept on disk; 0 keeps every snapshot (no pruning).
        shm_dir: where the staging arena file lives (default /dev/shm).
        allow_foreign_owner: restore snapshot files owned by another user (refused by
            default: ConfigError); default from CUDASNAP_ALLOW_FOREIGN_OWNER=1.
        job: arena name; default derived from the directory, so a restarted
            process finds the arena its predecessor left.
        rank / world_size: default from torch.distributed, else RANK / WORLD_SIZE.
        distributed: coordinate flushes and restores across ranks (default: when
            torch.distributed is initialised with more than one rank).
        replicas: which ranks hold identical state: "auto" (all ranks when the
            model is DDP-wrapped; HSDP: the ranks along the mesh's replicate dim; else
            none), "all", None, or a list of rank groups.
        rng_sources: RNG states saved at each boundary (drop "numpy"/"python"
            when the loop never uses them: saves ~30 us per boundary).
        health: start the health monitor, signal handlers and watchdog
            (default: on when running under ``cudasnap run`` or CUDASNAP_HEALTH=1).
        watchdog_s: hang watchdog timeout (no boundary for this long triggers a flush).
        arena_sync_max_bytes: staging arenas whose slots hold up to this many bytes of
            snapshot data in all are made at the first boundary, on the training
            thread (small models snapshot from step 0 on); larger ones, and the
            pre-fault / page-locking of an arena left by a previous process, are
            prepared on a background thread from construction on (see
            cudasnap.core.arena_prep): boundaries before it is ready are skipped and
            counted in ``stats()["skipped_not_ready"]`` (CPU backend: an arena left by
            a previous process takes snapshots from the first boundary, its pre-fault
            runs beside them). A ``flush()``, trigger or ``close()`` before it is ready
            makes it right then and snapshots the live state of the last boundary
            (``stats()["early_saves"]``; cudasnap.core.early). Default 16 MiB or
            $CUDASNAP_ARENA_SYNC_MAX_BYTES. ``bench/start_window.py`` measures the
            window (construction -> first protected step) by state size.
        node_replica: node-loss protection in distributed mode: each rank's newest
            COMPLETE snapshot is copied in the background into the shared memory of a
            partner rank on another node, and a replaced node's ranks restore from it
            (cudasnap.dist.replica; README "Node loss"). Default $CUDASNAP_NODE_REPLICA.
    """

    def __init__(self, model: Any, optimizer: Any = None,
                 directory: str | os.PathLike | None = None,
                 *, extra: Mapping[str, Any] | None = None, num_slots: int = 2,
                 backend: str = "auto", copy_threads: int | None = None,
                 flush_threads: int | None = None, chunk_bytes: int = DEFAULT_CHUNK,
                 keep: int = 3, shm_dir: str | os.PathLike | None = None, job: str | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 health: bool | None = None, watchdog_s: float | None = None,
                 policy: Any = None, inject: str | None = None, distributed: bool | None = None,
                 replicas: Any = "auto", rng_sources: tuple[str, ...] = RNG_SOURCES,
                 allow_foreign_owner: bool | None = None, spare_slot: bool = True,
                 flush_on_close: bool = True, fresh: bool | None = None,
                 arena_sync_max_bytes: int | None = None, snapshot_every: int = 1,
                 node_replica: bool | None = None) -> None:
        check_options(num_slots=num_slots, spare_slot=spare_slot, keep=keep,
                      chunk_bytes=chunk_bytes, backend=backend, snapshot_every=snapshot_every,
                      rng_sources=rng_sources)
        env = Settings.from_env()  # keyword arguments win over the environment
        vml_warmup.warm()  # before the loop's first float unary op (pytorch#188792)
        fresh = env.fresh if fresh is None else bool(fresh)
        # Zero-overhead mode (k > 1): copy every k-th boundary; a flush with no
        # optimizer step since the last boundary copies the live state (replay <= 1).
        self.snapshot_every = snapshot_every
        self._live, self._live_dirty, self._live_copy = None, True, None
        # Where snapshots are stored (a local path or an fsspec URL: cudasnap.storage); the
        # lock, directory id and flush log stay in a local directory either way.
        if directory is None:
            directory = env.directory or "ckpt"
        self.storage = open_storage(directory)
        self.directory = self.storage.local_dir
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else dist.get_rank() if dist_on else env.rank
        self.world_size = world_size if world_size is not None else \
            dist.get_world_size() if dist_on else env.world_size
        check_url(directory, self.world_size, fresh)
        self.last_step = self._restored = self._flushed_step = None
        self._resume_logged, self._partly_applied = False, None
        self.state = TrainingState(model, optimizer, extra)
        self.state.rng_sources = tuple(rng_sources)
        # Slots of the arena: the spare one lets snapshots go on while a flush holds a slot.
        self.num_slots = num_slots + (1 if spare_slot else 0)
        self.spare_slot, self.flush_on_close = bool(spare_slot), flush_on_close
        self.chunk_bytes, self.keep = chunk_bytes, keep
        # Restore refuses snapshot files of another user unless this (or
        # CUDASNAP_ALLOW_FOREIGN_OWNER=1) says so: see cudasnap.storage.posix._check_trust.
        self.allow_foreign_owner = allow_foreign_owner
        ncpu = os.cpu_count() or 2
        # Leave a core to the training thread; copies run at lower priority anyway.
        self.copy_threads = copy_threads or max(1, min(4, ncpu - 1))
        self.flush_threads = flush_threads or min(8, max(2, ncpu))
        shm = Path(shm_dir) if shm_dir else env.shm_dir
        # The arena name carries the directory's identity (cudasnap.format.paths).
        self.job = job or supervisor_job(env.job, env.directory, env.supervised,
                                         self.directory) or paths.snapshotter_job(self.directory, shm)
        self.arena_path = paths.arena_path(shm, self.job, self.rank)
        self._lock = posix.DirectoryLock(self.directory, self.rank)
        self._lock.acquire()
        removed = self.storage.clean_partial()
        if removed:
            log.warning("removed %d interrupted flush(es): %s", len(removed),
                        ", ".join(str(p).rstrip("/").rsplit("/", 1)[-1] for p in removed))
        self._backend_name = backend
        self._engine = self._cuda = self._arena = self._inherited = None
        self._layout = self._job_layout = self._job = None  # _job_layout: the copy's tensors
        self._fenced = [True, True]
        # Re-entrant: a signal handler may flush while the main thread is in boundary().
        self._slot_lock, self._flush_lock = threading.RLock(), threading.RLock()
        self._arena_lock = threading.RLock()  # arena adoption (cudasnap.core.early)
        self._boundary_event = self._early_thread = None
        self._early_saving = False
        self._supervised = env.supervised
        self._closed, self._boundaries = False, 0
        self._stats = Counters()
        # Bound of every wait on a copy (fences, the next submit, close()).
        self.wait_timeout_s = env.wait_s
        self._hooks = []
        self._install_fences()
        if arena_sync_max_bytes is None:
            arena_sync_max_bytes = env.arena_sync_max_bytes
        self._prep = arena_prep.ArenaPreparer(
            arena_prep.SYNC_MAX_BYTES if arena_sync_max_bytes is None else arena_sync_max_bytes,
            self._state_device())
        self._open_inherited_arena()
        if fresh:
            self._start_fresh()
        # As early as the state is known (issue 23 item 2): the set-up overlaps the rest of
        # the construction and whatever the program does before its first boundary.
        arena_prep.start_at_construction(self)  # large arenas: off the training thread
        try:
            self._init_triggers(dist_on, distributed, replicas, health, policy, inject,
                                watchdog_s, node_replica, fresh)
        except BaseException:
            arena_prep.shutdown(self, min(60.0, self.wait_timeout_s))
            self._lock.release()
            raise

    def _init_triggers(self, dist_on: bool, distributed: bool | None, replicas: Any,
                       health: bool | None, policy: Any, inject: str | None,
                       watchdog_s: float | None, node_replica: bool | None,
                       fresh: bool) -> None:
        """The distributed coordinator and the guard (health monitor, signals, watchdog)."""
        env = Settings.from_env()
        self.dist = None
        if distributed if distributed is not None else dist_on and self.world_size > 1:
            from .dist.coordinator import Coordinator
            from .dist.local import SnapshotterLocal

            if replicas == "auto":  # HSDP: the replicate dim of the DTensors' mesh
                from .core.sharded import replica_groups

                replicas = replica_groups([lt.owner for lt in self.state.live_tensors()
                                           if lt.owner is not None], self.world_size) or replicas
            self.dist = Coordinator(SnapshotterLocal(self), replicas=replicas,
                                    node_replica=node_replica, fresh=fresh)
        self.guard = None
        if health if health is not None else env.health:
            from .triggers.guard import Guard

            self.guard = Guard(self, policy=policy, inject=inject, watchdog_s=watchdog_s)
            self.guard.start()

    # -------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Counters: snapshots, skipped, bytes, boundary time (median us), copy GB/s, flushes."""
        s = self._stats.summary()
        s["backend"], s["layout"] = getattr(self, "backend", None), self._layout_info()
        if self.guard is not None:
            s["health_events"] = len(self.guard.history())
        s.update(self._staging_stats())
        return s

    def flush(self, wait: bool = True, timeout: float | None = 30.0) -> Path | None:
        """Writes the newest COMPLETE snapshot to disk now; returns its directory.

        With ``wait`` the running copy (if any) is given ``timeout`` seconds to
        complete first, so the flushed step is the newest one. Returns None when
        no snapshot exists yet. Before the staging arena is ready, the newest
        boundary is snapshotted synchronously first (cudasnap.core.early).
        """
        if self._closed:
            raise SnapshotError("flush() on a closed Snapshotter")
        early.before_flush(self, timeout)
        return super().flush(wait, timeout)

    def close(self, keep_arena: bool = False, flush: bool | None = None) -> None:
        """Waits for the running copy, flushes it (see ``flush_on_close``), stops threads
        and hooks, removes the arena (kept when ``keep_arena`` or when that flush failed).

        Before the staging arena is ready, the newest boundary is snapshotted first into
        an arena made now (cudasnap.core.early); a close() with none of the run's
        boundaries saved logs a WARNING."""
        if self._closed:
            return
        if flush is None:
            flush = self.flush_on_close and not keep_arena and self.dist is None
        if flush or keep_arena:
            early.at_close(self, keep_arena)
        arena_prep.shutdown(self, min(60.0, self.wait_timeout_s))  # a set-up in progress
        if flush and not final_flush(self):
            keep_arena = True  # the arena holds the only copy of the final state
        early.warn_if_nothing_saved(self)
        self._closed = True
        try:
            self._wait_job(min(60.0, self.wait_timeout_s))
        finally:
            if self.guard is not None:
                self.guard.stop()
            if self.dist is not None:
                self.dist.stop()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._stop_engine()
            self._release_arenas(unlink=not keep_arena)
            self._lock.release()

    def __enter__(self) -> "Snapshotter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.guard is not None:
            self.guard.on_exception(exc)
        # Keep the arena after a failure: the supervisor or the next process uses it.
        self.close(keep_arena=exc_type is not None)
