"""The Snapshotter: snapshot at every iteration boundary, flush just in time, restore.

Typical use: README.md "Quick start".

``boundary(step)`` captures host state, then hands a cached copy plan to the
copy engine and returns. The next ``optimizer.step()`` (a step pre-hook) and
the next forward of a module owning buffers (a forward pre-hook) wait for the
running copy, so no snapshot ever mixes two steps. ``flush()`` writes the
newest COMPLETE snapshot to disk; the health monitor and signal handlers call
it on a bad sign. This module is the facade: it makes the components of ``cudasnap.core``, each owning
its state (``cudasnap.core.wiring``; docs/design.md §2.1 draws them and their call
order), and delegates to them.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import config as cfg
from .config import Settings
from .core import vml_warmup
from .core.options import Options
from .core.rng import DRAWN_KEY
from .core.state import TrainingState
from .core.wiring import attach_triggers, wire
from .errors import SnapshotError, exception_active
from .storage import Storage, clean_partial, open_storage, ownership, url_of

if TYPE_CHECKING:
    from cudasnap._C import Arena

    from .storage.posix import StoredSnapshot
    from .storage.remote_base import RemoteSnapshot
    from .triggers.policy import Policy

log = logging.getLogger("cudasnap")


class Snapshotter:
    """Just-in-time snapshots of a model, its optimizer and extra host state.

    Args:
        model: a ``torch.nn.Module`` or a dict of them (names prefix tensor names).
        optimizer: a ``torch.optim.Optimizer``, a dict of them, or None; a wrapper of
            others is replaced by them (cudasnap.core.optim_wrap).
        directory: where flushed snapshots go (created 0700; checked writable now); default
            $CUDASNAP_DIR (``cudasnap run`` sets it) or ./ckpt; a URL's scheme picks its backend
            (cudasnap.storage.registry: ``s3://b/p``, any fsspec URL, ``objdir:///path``), or
            a ``cudasnap.storage.Storage`` made by the caller.
        extra: objects with ``state_dict``/``load_state_dict`` (schedulers, samplers,
            data-position objects) or ``torch.Generator``s; saved as JSON at each boundary.
        num_slots: shared-memory slots (>= 2): one COMPLETE while the next is WRITING
            (``self.num_slots``; with the spare and parity ones: ``self.arena_slots``).
        spare_slot: one more slot (default on), so a flush, which holds its slot while it
            writes, never stops the snapshots (``stats()["spare_slot_bytes"]`` of /dev/shm).
        chunk_bytes: the unit of a slot's checksums and a restore's verified reads (a
            multiple of 4096); default None: follows the state (cudasnap.core.slot_geometry).
        flush_on_close: ``close()`` flushes the newest snapshot unless it is on disk (not
            with ``close(keep_arena=True)`` nor in distributed mode: flush on every rank).
        fresh: start over: snapshots, ``latest`` and the flush log are moved aside to
            ``DIR/.old-<UTC time>/`` (nothing is deleted), the arena is removed, and
            ``restore_latest()`` returns 0. Default: CUDASNAP_FRESH=1 (``--fresh``).
        backend: "auto" (CUDA when state lives on a GPU), "cpu" or "cuda".
        copy_threads / flush_threads: worker threads of the copy engine / flusher.
        keep: committed snapshots kept on disk; 0 keeps every snapshot (no pruning).
        shm_dir: where the staging arena file lives (default /dev/shm).
        allow_foreign_owner: restore files owned by another user ($CUDASNAP_ALLOW_FOREIGN_OWNER).
        job: arena name; default from the directory (a restart finds its predecessor's).
        rank / world_size: default from torch.distributed, else RANK / WORLD_SIZE.
        distributed: coordinate flushes and restores across ranks (default: when
            torch.distributed is initialised with more than one rank).
        replicas: which ranks hold identical state: "auto" (all ranks when the
            model is DDP-wrapped; HSDP: the ranks along the mesh's replicate dim; else
            none), "all", None, or a list of rank groups.
        rng_sources: RNG states saved at each boundary (drop unused ones: ~30 us each).
        rng_restore: when a restore puts the RNG states back: "first_forward" (default)
            at the restore and, for the sources the loop does not draw from before its
            forward (seen by a probe of its first boundaries, cudasnap.core.rng.RestoredRng),
            again at the first forward of a registered model after it, so random numbers
            drawn in between (``iter(DataLoader)``, a trainer's set-up after its checkpoint
            load) are not taken from the resumed run's first step; "restore": only at the
            restore. Default $CUDASNAP_RNG_RESTORE.
        health: the health monitor, signals and watchdog (default: CUDASNAP_HEALTH=1).
        watchdog_s: hang watchdog timeout (no boundary for this long triggers a flush);
            default $CUDASNAP_WATCHDOG_S (unset: none).
        policy: a ``cudasnap.triggers.policy.Policy``: what each trigger does; default the
            built-in one with $CUDASNAP_POLICY's overrides.
        inject: scripted faults instead of NVML ("xid=79@step=40"); default $CUDASNAP_INJECT.
        arena_sync_max_bytes: arenas up to this many bytes are made at the first boundary
            on the training thread, larger ones in the background from construction on;
            boundaries before that are skipped and a flush copies the live state.
            Default 16 MiB or $CUDASNAP_ARENA_SYNC_MAX_BYTES (``bench/start_window.py``).
        snapshot_every: copy every k-th boundary (a flush copies the live state of a
            skipped one: replay <= 1; a process killed outright replays <= k). Default:
            the overhead budget picks k.
        overhead_budget: share of step time snapshots may cost (0: every boundary); k
            follows the measured cost (``stats()["cadence"]``). Default $CUDASNAP_OVERHEAD_BUDGET,
            else 0.01 on the CUDA backend and every boundary on the CPU one.
        device_staging: bytes of a device buffer (torch's allocator) each snapshot is
            first copied into, draining to the host behind the fences (snapshot-then-
            offload); "auto": up to half the free device memory; 0 (default): off.
        node_replica: node-loss protection in distributed mode: each rank's newest snapshot
            is copied into the shared memory of a partner rank on another node (True), or
            "xor:K": XOR parity over groups of K nodes (cudasnap.distributed.replica, .parity;
            README "Node loss"). Default $CUDASNAP_NODE_REPLICA.
        require_resume: ``restore_latest()`` raises instead of starting over when the
            job made progress nothing can restore. Default $CUDASNAP_REQUIRE_RESUME.
    """

    def __init__(self, model: object, optimizer: object = None,
                 directory: str | os.PathLike | Storage | None = None,
                 *, extra: Mapping[str, object] | None = None, num_slots: int = cfg.NUM_SLOTS,
                 backend: str = "auto", copy_threads: int | None = None,
                 flush_threads: int | None = None, chunk_bytes: int | None = None,
                 keep: int = cfg.KEEP, shm_dir: str | os.PathLike | None = None, job: str | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 health: bool | None = None, watchdog_s: float | None = None,
                 policy: Policy | None = None, inject: str | None = None, distributed: bool | None = None,
                 replicas: Any = "auto", rng_sources: tuple[str, ...] = cfg.RNG_SOURCES,
                 allow_foreign_owner: bool | None = None, spare_slot: bool = True,
                 flush_on_close: bool = True, fresh: bool | None = None,
                 arena_sync_max_bytes: int | None = None, snapshot_every: int | None = None,
                 node_replica: bool | str | None = None, require_resume: bool | None = None,
                 overhead_budget: float | None = None,
                 device_staging: int | str | None = None, rng_restore: str | None = None) -> None:
        env = Settings.from_env()  # keyword arguments win over the environment
        # Where snapshots are stored (a local path or an fsspec URL: cudasnap.storage); the
        # lock, directory id and flush log stay in a local directory either way.
        directory = env.directory or cfg.DIRECTORY if directory is None else directory
        rank, world_size, dist_on = cfg.resolve_rank(rank, world_size, env)

        def open_dir() -> Path:  # once every keyword passed its check
            self.storage = open_storage(directory, env)
            return self.storage.local_dir

        opts = self.options = Options.resolve(
            env, directory=url_of(directory), open_dir=open_dir,
            rank=rank, world_size=world_size, num_slots=num_slots, spare_slot=spare_slot,
            chunk_bytes=chunk_bytes, keep=keep, backend=backend, copy_threads=copy_threads,
            flush_threads=flush_threads, snapshot_every=snapshot_every,
            overhead_budget=overhead_budget, device_staging=device_staging,
            arena_sync_max_bytes=arena_sync_max_bytes, allow_foreign_owner=allow_foreign_owner,
            fresh=fresh, require_resume=require_resume, flush_on_close=flush_on_close,
            rng_sources=rng_sources, rng_restore=rng_restore, node_replica=node_replica,
            shm_dir=shm_dir, job=job, health=health, watchdog_s=watchdog_s, inject=inject)
        vml_warmup.warm()  # before the loop's first float unary op (pytorch#188792)
        self.directory = self.storage.local_dir
        self.state = TrainingState(model, optimizer, extra)
        self.state.rng_sources = opts.copy.rng_sources
        self.state.restored_rng.again = opts.copy.rng_restore == "first_forward"
        self._lock = ownership.DirectoryLock(self.directory, opts.dist.rank, opts.dist.supervised)
        self._lock.acquire()
        clean_partial(self.storage)
        self._closed = False
        # The components (docs/design.md §2.1).
        parts = wire(self.state, self.storage, opts)
        (self._counters, self._timeline, self._backend, self._layouts, self._keeper,
         self._copier, self._flusher, self._restorer, self._early, self._hooks) = parts
        try:
            self._init_triggers(env, dist_on, distributed, replicas, policy, node_replica)
            attach_triggers(parts, self.dist, self.guard)  # then starts the guard
        except BaseException:
            self._keeper.shutdown(opts.waits.close_s)
            self._lock.release()
            raise

    def _init_triggers(self, env: Settings, dist_on: bool, distributed: bool | None,
                       replicas: Any, policy: Policy | None, node_replica: bool | str | None) -> None:
        """The distributed coordinator and the guard (health monitor, signals, watchdog;
        started by the caller once the components know both)."""
        self.dist = None
        if distributed if distributed is not None else dist_on and self.world_size > 1:
            from .distributed.coordinator import Coordinator
            from .distributed.local import ComponentsLocal

            if replicas == "auto":  # HSDP: the replicate dim of the DTensors' mesh
                from .core.sharded import replica_groups

                replicas = replica_groups([lt.owner for lt in self.state.live_tensors()
                                           if lt.owner is not None], self.world_size) or replicas
            local = ComponentsLocal(self.options, self.state, self.directory, self._timeline,
                                    self._keeper, self._flusher, self._restorer, self._early)
            self.dist = Coordinator(local, settings=env, replicas=replicas, node_replica=node_replica,
                                    fresh=self.options.flush.fresh)
        self.guard = None
        if (h := self.options.health).on:
            from .triggers.guard import Guard
            from .triggers.policy import Policy

            self.guard = Guard(self, policy=policy or Policy.parse(h.policy or ""),
                               inject=h.inject or "", watchdog_s=h.watchdog_s, poll_s=h.poll_s,
                               first_of_job=h.first_of_job)

    # ---------------------------------------------------------- snapshots
    def boundary(self, step: int, **values: object) -> None:
        """Snapshot the state after ``step``'s optimizer step; returns at once.

        ``values``: plain per-step state (JSON-able values, tensors) saved with the
        step and found in ``snap.values`` after a restore (cudasnap.core.values).

        ``step`` is a non-negative int, strictly above the previous boundary's step
        or, after ``restore_latest()``/``rollback()``, above the restored step;
        anything else raises ConfigError naming both steps (see cudasnap.core.timeline).
        """
        t0 = time.perf_counter_ns()
        if self._closed:
            raise SnapshotError("boundary() on a closed Snapshotter")
        tl = self._timeline
        step = tl.advance(step)
        rr = self.state.restored_rng
        rr.at_boundary(self.state.rng_sources)  # cudasnap.core.rng.RestoredRng
        if rr.saved is not None:
            values[DRAWN_KEY] = rr.saved
        try:
            self._copier.snapshot(step, t0, tl.boundaries, values)
        finally:
            self._early.boundary_done(step)  # a flush waiting for this boundary (core.early)
            # After the submit: a SIGTERM flush raised here waits for this very step.
            if self.guard is not None:
                self.guard.on_boundary(step)

    def fence(self) -> None:
        """Orders the caller's next writes of the state after the running copy.

        Call it before writing state tensors in a way the optimizer-step and
        forward hooks do not see: an EMA ``lerp_``/``copy_`` outside
        ``optimizer.step()``, manual edits, a CUDA-graph replay of the step.
        CUDA backend: the current stream waits on the copy (no host block);
        CPU backend: a host wait. A no-op when no copy is running. A wait longer
        than ``wait_timeout_s`` abandons that snapshot (logged) instead of hanging.
        """
        self._copier.fence(1)

    def add_writer_stream(self, stream: object) -> None:
        """``stream`` (a ``torch.cuda.Stream``) writes the state besides the one calling
        ``boundary()`` (a step or CUDA-graph replay run there): each copy waits for its
        queued work, each fence (hooks, ``fence()``) holds it too. CPU backend: ignored."""
        self._copier.add_writer(stream)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the newest boundary's snapshot is COMPLETE (True) or the timeout passes."""
        self._copier.settle_deferred(timeout)
        return self._copier.wait_job(timeout)

    def invalidate_layout(self) -> None:
        """Forces the copy plan to be rebuilt at the next boundary.

        Needed only after replacing state tensors outside ``optimizer.step()`` /
        ``load_state_dict`` (e.g. ``opt.state[p]["exp_avg"] = t``); such a
        replacement is otherwise found by the rotating identity check within
        ``ceil(n / layout_watch.WINDOW)`` boundaries (n: state tensors; each boundary
        checks a window of them), and tensors added to a module or an existing
        ``opt.state[p]`` only by the full re-scan every ``Layouts.RESCAN_EVERY`` (64) x
        ``max(1, ceil(n / (4 * WINDOW)))`` boundaries (see core.copy_plan.Layout). The
        running copy keeps reading the old tensors, which stay alive until it completes.
        """
        self._layouts.invalidate()

    def coverage(self) -> dict[str, object]:
        """Live device bytes vs bytes covered by the registered state (CUDA backend)."""
        return self._layouts.coverage()

    def arena_ready(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout`` s) for a background arena set-up; True when none runs.

        The next boundary then adopts the arena and snapshots again.
        """
        return self._keeper.ready(timeout)

    def staged_arenas(self) -> list[Arena]:
        """This rank's open arenas: its own, then one inherited from a predecessor."""
        return self._keeper.staged_arenas()

    def copy_stream_handle(self) -> int | None:
        """The CUDA backend's copy stream (a ``cudaStream_t`` as an int, for profilers and
        benchmarks: ``torch.cuda.ExternalStream``); None before the first boundary or on CPU."""
        return self._backend.copy_stream_handle()

    backend = property(lambda self: self._backend.name,
                       doc='"cpu" or "cuda" from the first boundary on (None before).')
    last_step = property(lambda self: self._timeline.last_step,
                         doc="The newest boundary's step (None before the first).")

    # -------------------------------------------------------------- flush
    def flush(self, wait: bool = True, timeout: float | None = cfg.FLUSH_WAIT_S) -> Path | str | None:
        """Writes the newest COMPLETE snapshot to disk now; returns its directory (its URL
        for an object store).

        With ``wait`` the running copy (if any) is given ``timeout`` seconds to
        complete first, so the flushed step is the newest one. Returns None when
        no snapshot exists yet. Before the staging arena is ready, the newest
        boundary is snapshotted synchronously first (cudasnap.core.early).
        ``timeout`` (None: unbounded) also bounds each wait on the way down: the copy
        of a boundary not copied yet, and the storage's wait on other writers of the
        ``latest`` pointer (``Storage.write_slot``; past it ``latest`` stays, the
        step is committed). The write of the data itself is never cut short.

        Multi-rank: called by the program itself with ``wait`` (e.g. at the end of the
        job, on every rank), the coordinated round waits, bounded, for every live rank's
        copy of this rank's newest step, so all agree on the last step every rank
        reached. A trigger's flush (the guard's: signals, health, peer failure) or one
        without ``wait`` waits for no rank's boundary.
        """
        if self._closed:
            raise SnapshotError("flush() on a closed Snapshotter")
        self._early.before_flush(timeout)
        return self._flusher.flush(wait, timeout)

    def flush_if_new(self, wait_s: float = cfg.FINAL_FLUSH_WAIT_S) -> Path | str | None:
        """Flushes the newest COMPLETE snapshot unless that step is already on disk
        (``close()``'s final flush); None when there was nothing new to write."""
        return self._flusher.flush_if_new(wait_s)

    # ------------------------------------------------------------ restore
    def restore_latest(self) -> int:
        """Loads the newest snapshot that verifies; returns the step to resume at (0 if none).

        Sources, newest step first: this node's shared-memory slot (fastest),
        then committed snapshots on disk. A corrupt or torn candidate is skipped
        with a warning naming it; a snapshot that does not fit the live
        model/optimizer raises IncompatibleSnapshot.
        """
        if self._closed:
            raise SnapshotError("restore_latest() on a closed Snapshotter")
        return self._restorer.restore_latest()

    def rollback(self) -> int:
        """In-process rollback: copy the newest COMPLETE slot back into the live tensors.

        For a fault the process survives (a NaN loss, a peer failure): training
        continues at the returned step (snapshot step + 1).
        """
        if self._closed:
            raise SnapshotError("rollback() on a closed Snapshotter")
        return self._restorer.rollback()

    def restore_dir(self, ref: Path | StoredSnapshot | RemoteSnapshot) -> int:
        """Applies a stored snapshot; returns its step. ``ref``: a snapshot of
        ``self.storage``'s listing, or a local step/rank directory."""
        return self._restorer.restore_dir(ref)

    def restore_slot(self, arena: Arena, slot: int, where: str) -> int:
        """Applies an arena slot (validated first); returns its step."""
        return self._restorer.restore_slot(arena, slot, where)

    def newest_known_step(self) -> int:
        """Newest step in shared memory or on disk, or -1 (no validation of the data)."""
        return self._restorer.newest_known_step()

    def record_restore(self, source: str, step: int, where: str) -> None:
        """Notes where a restore came from (``stats()["restore"]``; the coordinator's vote)."""
        self._restorer.record_restore(source, step, where)

    def last_restore(self) -> dict[str, object] | None:
        """What the last restore loaded: source, step, where (None before any)."""
        return self._restorer.last_restore()

    # The resolved options (read-only; ``options`` holds them all: cudasnap.core.options).
    wait_timeout_s = property(lambda self: self.options.waits.copy_s, doc="Bound of every wait "
                              "on a copy (fences, submit, close()): CUDASNAP_WAIT_S.")
    rank = property(lambda self: self.options.dist.rank, doc="This process's rank.")
    world_size = property(lambda self: self.options.dist.world_size, doc="The job's ranks.")
    job = property(lambda self: self.options.arena.job, doc="The job id (names the arena).")
    arena_path = property(lambda self: self.options.arena.path, doc="This rank's arena file.")
    keep = property(lambda self: self.options.flush.keep, doc="Committed snapshots kept.")
    num_slots = property(lambda self: self.options.arena.num_slots, doc="The slots asked for.")
    arena_slots = property(lambda self: self.options.arena.slots, doc="The arena's slots in all.")
    chunk_bytes = property(lambda self: self.options.arena.chunk_bytes, doc="None: the state's.")
    copy_threads = property(lambda self: self.options.copy.threads, doc="Copy engine threads.")
    flush_threads = property(lambda self: self.options.flush.threads, doc="Flusher threads.")

    @property
    def values(self) -> dict[str, object]:
        """The ``boundary(step, **values)`` of the restored step ({} before a restore)."""
        return self.state.values


    # -------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Counters: snapshots, skipped, bytes, boundary time (median us), copy GB/s, flushes."""
        s = self._counters.summary()
        s["backend"], s["layout"] = self._backend.name, self._layouts.info()
        s["cadence"] = self._copier.cadence.info()  # k, budget, measured overhead
        if self.guard is not None:
            s["health_events"] = len(self.guard.history())
        s.update(self._keeper.stats(), **self._backend.stats())
        return s

    def close(self, keep_arena: bool | None = None, flush: bool | None = None) -> None:
        """Waits for the running copy, flushes it (see ``flush_on_close``), stops threads
        and hooks, and removes the arena unless it may hold the only copy of the newest
        state.

        ``keep_arena``: None (default) keeps the arena when ``close()`` runs while an
        exception propagates (an ``except``/``finally`` block, ``__exit__``: a trainer's
        own exception path), when the final flush failed, or, with several ranks, while
        this rank's newest snapshot is not committed (a restart assembles the step from
        the ranks' arenas); True always keeps it, False removes it (the state is not
        needed). A kept arena is named at exit (cudasnap.core.arena_exit).

        A newest boundary not snapshotted (arena or plan not ready) is copied first
        (cudasnap.core.early); a close() with no boundary saved logs a WARNING."""
        if self._closed:
            return
        failing = exception_active()
        keep = bool(keep_arena) or (keep_arena is None and failing is not None)
        if flush is None:
            flush = self.options.flush.on_close and keep_arena is not True and self.dist is None
        if flush or keep_arena is not False:
            self._early.at_close(keep)
        self._keeper.shutdown(self.options.waits.close_s)  # a set-up in progress
        if flush and not self._flusher.final_flush():
            keep = True  # the arena holds the only copy of the final state
        self._early.warn_if_nothing_saved()
        self._closed = True
        try:
            self._copier.wait_job(self.options.waits.close_s)
        finally:
            if self.guard is not None:
                self.guard.stop()
            if self.dist is not None and not self.dist.stop(keep_arena is not False) and \
                    keep_arena is None:
                keep = True  # not committed: the restart's vote reads this arena
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._layouts.join_build(self.options.waits.close_s)  # it may make the engine
            self._layouts.release_at_close(self._backend.stop())
            if keep and keep_arena is None and self._keeper.staged_arenas():
                log.warning("cudasnap: close() keeps the staging arena %s%s: a restart "
                            "resumes from it", self.options.arena.path,
                            f" (closing during {type(failing).__name__})" if failing else
                            " (its newest snapshot is not on disk)")
            self._keeper.release(unlink=not keep)
            self._lock.release()

    def __enter__(self) -> "Snapshotter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and self.guard is not None:
            self.guard.on_exception(exc)
        # Keep the arena after a failure: the supervisor or the next process uses it.
        self.close(keep_arena=True if exc_type is not None else None)
