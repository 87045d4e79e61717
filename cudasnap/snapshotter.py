"""The Snapshotter: snapshot at every iteration boundary, flush just in time, restore.

Typical use::

    snap = cudasnap.Snapshotter(model, optimizer, directory="ckpt/", extra={"sched": sched})
    start = snap.restore_latest()          # 0 on a fresh run
    for step in range(start, steps):
        loss = model(batch(step)).sum(); loss.backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
        snap.boundary(step)                # returns at once; the copy runs in the background

``boundary(step)`` captures host state, then hands a cached copy plan to the
copy engine and returns. The next ``optimizer.step()`` (a step pre-hook) and
the next forward of a module owning buffers (a forward pre-hook) wait for the
running copy, so no snapshot ever mixes two steps. ``flush()`` writes the
newest COMPLETE snapshot to disk; the health monitor and signal handlers call
it on a bad sign.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import arena_prep, layout_watch
from ._native import native
from .errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot, SnapshotError, StagingError
from .format import manifest as fmt
from .format import paths
from .format.manifest import tensor_entry, validate_manifest, validate_tensors
from .format.paths import is_url
from .layout_watch import Watch, identity_entries
from .state import LiveTensor, TrainingState, single_cuda_device
from .storage import open_storage, posix
from .timeline import arena_slots, check_step, final_flush, fresh_from_env, move_aside, resume_message
from .tools.progress import io_progress

log = logging.getLogger("cudasnap")

DEFAULT_CHUNK = 4 << 20
MIN_META = 1 << 20


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} is not an integer") from None


class _Layout:
    """Live tensors + their copy plan + the manifest prefix (written once per slot)."""

    def __init__(self, tensors: list[LiveTensor], plan: Any, prefix: bytes, sig: tuple[int, ...],
                 watch: Watch):
        self.tensors = tensors
        self.plan = plan
        # The tensor table, held in C++: a slot that holds it gets only the host suffix.
        self.prefix = native().MetaPrefix(prefix)
        self.prefix_len = len(prefix)
        self.signature = sig
        self.objects = [lt.tensor for lt in tensors]
        # Every planned storage stays allocated while this layout lives, so a copy
        # of a plan not yet found stale (see layout_watch) never reads freed memory.
        self.keep = [t.detach() for t in self.objects]
        self.guard = native().LayoutGuard(self.objects)
        self.watch = watch
        # Full re-scan period: amortised O(1) per boundary whatever the tensor count.
        per = 4 * layout_watch.WINDOW
        self.rescan_every = Snapshotter.RESCAN_EVERY * max(1, -(-len(tensors) // per))
        self.plan_key: int | None = None
        self.checks = 0  # boundaries that used this layout (drives the full re-scan)

    def ptrs_changed(self) -> bool:
        return self.guard.first_moved() >= 0

    def same_objects(self, tensors: list[LiveTensor]) -> bool:
        return len(tensors) == len(self.objects) and all(
            a.tensor is b for a, b in zip(tensors, self.objects))


class Snapshotter:
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
            cudasnap.arena_prep): boundaries before it is ready are skipped and
            counted in ``stats()["skipped_not_ready"]``. Default 16 MiB or
            $CUDASNAP_ARENA_SYNC_MAX_BYTES.
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
                 replicas: Any = "auto",
                 rng_sources: tuple[str, ...] = ("torch", "cuda", "numpy", "python"),
                 allow_foreign_owner: bool | None = None, spare_slot: bool = True,
                 flush_on_close: bool = True, fresh: bool | None = None,
                 arena_sync_max_bytes: int | None = None, snapshot_every: int = 1) -> None:
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) \
                or snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
        # Zero-overhead mode (k > 1): copy every k-th boundary; a flush with no
        # optimizer step since the last boundary copies the live state (replay <= 1).
        self.snapshot_every = snapshot_every
        self._live: tuple[int, bytes] | None = None  # newest uncopied boundary: step, host
        self._live_dirty = True  # state written since the last boundary
        self._live_copy: threading.Event | None = None  # a flush is copying the live state
        if num_slots < 2:
            raise ConfigError(f"num_slots must be >= 2, got {num_slots}")
        if num_slots + bool(spare_slot) > 8:
            raise ConfigError(f"num_slots must be <= {8 - bool(spare_slot)} (the arena holds at "
                              f"most 8 slots, spare_slot={bool(spare_slot)}), got {num_slots}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"keep must be an int >= 0 (0 keeps every snapshot), got {keep!r}")
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ConfigError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
        if backend not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
        if directory is None:
            directory = os.environ.get("CUDASNAP_DIR", "ckpt")
        # Where snapshots are stored (a local path or an fsspec URL: cudasnap.storage); the
        # lock, directory id and flush log stay in a local directory either way.
        self.storage = open_storage(directory)
        self.directory = self.storage.local_dir
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if dist_on else _env_int("RANK", 0)
        if world_size is None:
            world_size = dist.get_world_size() if dist_on else _env_int("WORLD_SIZE", 1)
        self.rank, self.world_size = rank, world_size
        if is_url(directory) and (world_size > 1 or fresh_from_env(fresh)):
            raise ConfigError(f"{directory}: object-store snapshots are single-rank and cannot "
                              "be moved aside (fresh) for now: use a local or shared file "
                              "system directory, or a new URL prefix for a fresh start")
        self.last_step: int | None = None
        self.state = TrainingState(model, optimizer, extra)
        bad = set(rng_sources) - {"torch", "cuda", "numpy", "python"}
        if bad:
            raise ConfigError(f"unknown rng_sources {sorted(bad)}; use torch, cuda, numpy, python")
        self.state.rng_sources = tuple(rng_sources)
        # Slots of the arena: the spare one lets snapshots go on while a flush holds a slot.
        self.num_slots = num_slots + (1 if spare_slot else 0)
        self.spare_slot = bool(spare_slot)
        self.flush_on_close = flush_on_close
        self._restored: int | None = None  # step put back by the last restore/rollback
        self._flushed_step: int | None = None
        self._resume_logged = False
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        # Restore refuses snapshot files of another user unless this (or
        # CUDASNAP_ALLOW_FOREIGN_OWNER=1) says so: see cudasnap.storage.posix._check_trust.
        self.allow_foreign_owner = allow_foreign_owner
        self._partly_applied: str | None = None
        ncpu = os.cpu_count() or 2
        # Leave a core to the training thread; copies run at lower priority anyway.
        self.copy_threads = copy_threads or max(1, min(4, ncpu - 1))
        self.flush_threads = flush_threads or min(8, max(2, ncpu))
        shm = Path(shm_dir or os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
        # The arena name carries the directory's identity (cudasnap.format.paths), not just its path.
        env_job = os.environ.get("CUDASNAP_JOB")
        sup_dir = os.environ.get("CUDASNAP_DIR")
        if env_job and sup_dir and os.environ.get("CUDASNAP_SUPERVISED") == "1" and \
                os.path.realpath(sup_dir) != os.path.realpath(self.directory):
            # The supervisor flushes and restarts for its --dir; this Snapshotter writes elsewhere.
            log.warning("cudasnap run --dir %s, but this Snapshotter's directory is %s: the "
                        "supervisor's flush after a crash goes to its own directory and the "
                        "restart restores from %s; pass the same directory to both", sup_dir,
                        self.directory, self.directory)
            env_job = None  # its job id names the supervisor directory's arena, not this one's
        self.job = job or env_job or paths.snapshotter_job(self.directory, shm)
        self.arena_path = paths.arena_path(shm, self.job, self.rank)
        self._lock = posix.DirectoryLock(self.directory, self.rank)
        self._lock.acquire()
        removed = self.storage.clean_partial()
        if removed:
            log.warning("removed %d interrupted flush(es): %s", len(removed),
                        ", ".join(str(p).rstrip("/").rsplit("/", 1)[-1] for p in removed))
        self._backend_name = backend
        self._engine: Any = None
        self._cuda: Any = None
        self._arena: Any = None
        self._inherited: Any = None
        self._layout: _Layout | None = None
        self._job: Any = None
        self._fenced = [True, True]
        # Re-entrant: a signal handler may flush while the main thread is in boundary().
        self._slot_lock = threading.RLock()
        self._flush_lock = threading.RLock()
        self._closed = False
        self._boundaries = 0
        self._stats: dict[str, Any] = {
            "snapshots": 0, "skipped": 0, "bytes": 0, "boundary_ns": [], "fence_wait_ns": 0,
            "last_copy_seconds": None, "last_copy_gbps": None, "flushes": 0,
            "last_flush_seconds": None, "last_flush_path": None, "arena_setup_seconds": None,
            "health_events": 0, "restore": None, "layout_rebuilds": 0, "abandoned": 0,
            "arena_regrowths": 0, "skipped_not_ready": 0, "skipped_every": 0, "live_saves": 0}
        # Bound of every wait on a copy (fences, the next submit, close()).
        self.wait_timeout_s = float(os.environ.get("CUDASNAP_WAIT_S") or 120.0)
        self._job_layout: _Layout | None = None  # keeps the running copy's tensors alive
        self._hooks: list[Any] = []
        self._install_fences()
        if arena_sync_max_bytes is None:
            arena_sync_max_bytes = _env_int("CUDASNAP_ARENA_SYNC_MAX_BYTES",
                                            arena_prep.SYNC_MAX_BYTES)
        self._prep = arena_prep.ArenaPreparer(arena_sync_max_bytes, self._state_device())
        self._open_inherited_arena()
        if fresh_from_env(fresh):
            move_aside(self.directory, self._inherited, self.flush_threads,
                       None if self.world_size == 1 else f"rank-{self.rank:05d}")
            if self._inherited is not None:
                self._inherited.unlink()
                self._inherited = None
        self.dist: Any = None
        if distributed is None:
            distributed = dist_on and self.world_size > 1
        if distributed:
            from .dist.coordinator import Coordinator
            from .dist.local import SnapshotterLocal

            if replicas == "auto":  # HSDP: the replicate dim of the DTensors' mesh
                from .core.sharded import replica_groups

                replicas = replica_groups([lt.owner for lt in self.state.live_tensors()
                                           if lt.owner is not None], self.world_size) or replicas
            self.dist = Coordinator(SnapshotterLocal(self), replicas=replicas)
        arena_prep.start_at_construction(self)  # large arenas: off the training thread
        self.guard: Any = None
        if health is None:
            health = os.environ.get("CUDASNAP_HEALTH", "") == "1"
        if health:
            from .triggers.guard import Guard

            self.guard = Guard(self, policy=policy, inject=inject, watchdog_s=watchdog_s)
            self.guard.start()

    # ------------------------------------------------------------ fences
    def _install_fences(self) -> None:
        for opt in self.state.optimizers.values():
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self._fence(1)))
            self._hooks.append(opt.register_load_state_dict_pre_hook(self._before_load))
            self._hooks.append(opt.register_load_state_dict_post_hook(
                lambda *_: self.invalidate_layout()))
        for mod in self.state.models.values():
            seen = set()
            for sub in [mod, *[m for m in mod.modules() if any(True for _ in m.buffers(False))]]:
                if id(sub) not in seen:
                    seen.add(id(sub))
                    self._hooks.append(sub.register_forward_pre_hook(lambda *_: self._fence(0)))

    def _before_load(self, *_: Any) -> None:
        self._fence(1)  # never let load_state_dict race a running copy

    def fence(self) -> None:
        """Orders the caller's next writes of the state after the running copy.

        Call it before writing state tensors in a way the optimizer-step and
        forward hooks do not see: an EMA ``lerp_``/``copy_`` outside
        ``optimizer.step()``, manual edits, a CUDA-graph replay of the step.
        CUDA backend: the current stream waits on the copy (no host block);
        CPU backend: a host wait. A no-op when no copy is running. A wait longer
        than ``wait_timeout_s`` abandons that snapshot (logged) instead of hanging.
        """
        self._fence(1)

    def _fence(self, phase: int) -> None:
        # Every caller is about to write the state: the live state is no longer the
        # last boundary's. Set before the check below (a flush reads it the other way).
        self._live_dirty = True
        ev = self._live_copy
        if ev is not None:  # a flush copies the live state right now: let it finish
            ev.wait(self.wait_timeout_s)
        job = self._job
        if job is None or self._fenced[phase]:
            return
        t0 = time.perf_counter_ns()
        stream = self._cuda.current_stream() if self._cuda is not None else 0
        if not self._engine.fence(job, phase, stream):
            self._stats["abandoned"] += 1
            log.error("snapshot of step %d abandoned: its copy did not reach phase %d within "
                      "%.0f s (copier stalled or GPU hung); the previous snapshot stays the "
                      "newest", job.step, phase, self.wait_timeout_s)
        self._fenced[phase] = True
        if phase == 1:
            self._fenced[0] = True
        self._stats["fence_wait_ns"] += time.perf_counter_ns() - t0

    # ------------------------------------------------------------ engine
    def _ensure_engine(self, tensors: list[LiveTensor]) -> None:
        if self._engine is not None:
            return
        on_gpu = any(lt.tensor.is_cuda for lt in tensors)
        name = self._backend_name
        if name == "auto":
            name = "cuda" if on_gpu else "cpu"
        if name == "cpu" and on_gpu:
            raise ConfigError("backend='cpu' but some state lives on a CUDA device")
        if name == "cuda":
            from ._cuda import CudaBackend

            dev = single_cuda_device(tensors)
            self._cuda = CudaBackend(dev, crc_threads=self.copy_threads,
                                     wait_timeout_s=self.wait_timeout_s)
            self._engine = self._cuda.engine
        else:
            self._engine = native().CpuCopyEngine(self.copy_threads)
            self._engine.wait_timeout_s = self.wait_timeout_s
        self.backend = name
        log.info("cudasnap: %s backend, %d copy threads, arena %s", name, self.copy_threads,
                 self.arena_path)

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
        if owner != os.getpid() and _pid_alive(owner):
            raise ConfigError(f"staging arena {self.arena_path} belongs to running process {owner}")
        arena.claim_owner()  # from now on `cudasnap gc` sees this process as the user
        self._inherited = arena
        slot = arena.newest_complete()
        if slot >= 0:
            info = arena.slot_info(slot)
            log.info("found snapshot of step %d in shared memory (%s), left by pid %d",
                     info["step"], self.arena_path, info["writer_pid"])

    def _build_layout(self) -> _Layout:
        tensors = self.state.live_tensors()
        self._ensure_engine(tensors)
        if self._cuda is not None:
            single_cuda_device(tensors, self._cuda.index)
        plan, offsets = self._make_plan(tensors)
        entries = []
        for lt, off in zip(tensors, offsets):
            e = tensor_entry(lt.name, lt.group, lt.tensor, off, lt.phase)
            if lt.param_index is not None:
                e["param_index"], e["state_key"] = lt.param_index, lt.state_key
            if lt.aliases:
                e["aliases"] = lt.aliases
            if lt.shard is not None:  # a DTensor's local shard (cudasnap.core.sharded)
                e["shard"] = lt.shard
            entries.append(e)
        validate_tensors(entries, plan.total_bytes, "layout")
        import json

        head = fmt.head(rank=self.rank, world_size=self.world_size, job=self.job,
                        backend=self.backend, torch=torch.__version__)
        prefix = (json.dumps(head, separators=(",", ":"))[:-1] + ',"tensors":' +
                  json.dumps(entries, separators=(",", ":")) + ',"host":').encode()
        self._stats["layout_rebuilds"] += 1
        key = None
        if self._cuda is not None:
            self._cuda.watch(tensors)
            key = self._cuda.plan_key()
        log.debug("layout: %d tensors, %d copy ranges, %.1f MB", len(tensors), plan.num_ranges,
                  plan.total_bytes / 1e6)
        lay = _Layout(tensors, plan, prefix, self.state.signature(),
                      Watch(identity_entries(self.state, tensors)))
        lay.plan_key = key
        return lay

    def _make_plan(self, tensors: list[LiveTensor]) -> tuple[Any, list[int]]:
        """Copy plan + each tensor's offset in the slot.

        Host spans merge across small gaps. Device spans never merge across
        allocator segments (a gap between two cudaMalloc segments may be
        unmapped): with allocator tracking they are coalesced by the registry
        within segments; without it only overlapping spans merge.
        """
        C = native()
        host = [i for i, lt in enumerate(tensors) if not lt.tensor.is_cuda]
        dev = [i for i, lt in enumerate(tensors) if lt.tensor.is_cuda]
        ptrs = [tensors[i].tensor.data_ptr() for i in host]
        sizes = [tensors[i].nbytes for i in host]
        phases = [tensors[i].phase for i in host]
        where: list[tuple[int, int]] = [(-1, 0)] * len(tensors)
        for j, i in enumerate(host):
            where[i] = (j, 0)
        if dev:
            ranges = placement = None
            if self._cuda is not None and self._cuda.registry is not None:
                try:
                    ranges, placement = self._cuda.coalesce([tensors[i] for i in dev], 4096)
                except SnapshotError as e:
                    log.warning("allocator-tracked coalescing unavailable (%s); "
                                "copying tensor by tensor", e)
            if ranges is None or placement is None:
                ranges = [(tensors[i].tensor.data_ptr(), tensors[i].nbytes) for i in dev]
                placement = [(k, 0) for k in range(len(dev))]
            base = len(ptrs)
            rphase = [1] * len(ranges)
            for i, (r, _) in zip(dev, placement):
                if r >= 0:
                    rphase[r] = min(rphase[r], tensors[i].phase)  # a buffer inside: fence early
            for (addr, n), ph in zip(ranges, rphase):
                ptrs.append(int(addr))
                sizes.append(int(n))
                phases.append(ph)
            for i, (r, off) in zip(dev, placement):
                where[i] = (base + r, int(off)) if r >= 0 else (-1, 0)
        is_host = [True] * len(host) + [False] * (len(ptrs) - len(host))
        # Host spans may merge across small gaps; with device ranges present the
        # gap is 0 so ranges from different segments never merge.
        plan = C.build_plan(ptrs, sizes, phases, is_host, self.chunk_bytes,
                            0 if dev else 4096, 4096)
        offs = plan.tensor_offsets
        offsets = [offs[r] + off if r >= 0 else 0 for r, off in where]
        return plan, offsets

    def invalidate_layout(self) -> None:
        """Forces the copy plan to be rebuilt at the next boundary.

        Needed only after replacing state tensors outside ``optimizer.step()`` /
        ``load_state_dict`` (e.g. ``opt.state[p]["exp_avg"] = t``); such a
        replacement is otherwise found by the full re-scan every
        ``ceil(n / layout_watch.WINDOW)`` boundaries (n: state tensors; each boundary
        checks a window of them), and tensors added to a module by the full re-scan
        every ``RESCAN_EVERY`` (x n / 2,048) boundaries. The running copy keeps
        reading the old tensors, which stay alive until it completes.
        """
        self._layout = None

    RESCAN_EVERY = 64

    def _current_layout(self) -> _Layout:
        lay = self._layout
        if lay is not None and lay.signature == self.state.signature():
            lay.checks += 1
            periodic = lay.checks % lay.rescan_every == 0
            # O(WINDOW) whatever the tensor count: see cudasnap.layout_watch.
            if not lay.watch.check_next(layout_watch.WINDOW):
                if self._cuda is not None and lay.plan_key is not None and not periodic \
                        and self._cuda.plan_key() == lay.plan_key:
                    return lay  # O(1): no watched block was freed since the plan was built
                if lay.guard.check_next(layout_watch.WINDOW) < 0 and (
                        not periodic or lay.same_objects(self.state.live_tensors())):
                    return lay
        self._layout = self._build_layout()
        return self._layout

    def _ensure_arena(self, plan: Any, meta_len: int) -> Any:
        """The arena for ``plan``, or None (this boundary is skipped; see arena_prep)."""
        return arena_prep.ensure(self, plan, meta_len, int(self.last_step or 0))

    def _make_arena_here(self, regrow: bool, capacity: int, meta_capacity: int) -> Any:
        """A small arena, made on the calling (training) thread."""
        if regrow:
            log.warning("state grew; re-creating the staging arena")
            if not self._retire_arena():
                return None
        if self._inherited is not None:
            arena_prep.drop(self._inherited)
            self._inherited = None
        t0 = time.perf_counter()
        self.arena_path.unlink(missing_ok=True)
        arena = self._create_arena(capacity, meta_capacity)
        self._arena = self._adopt(arena)
        self._stats["arena_setup_seconds"] = time.perf_counter() - t0
        log.info("staging arena %s: %d slots x %.1f MB, set up in %.2f s", self.arena_path,
                 self.num_slots, capacity / 1e6, self._stats["arena_setup_seconds"])
        return self._arena

    def _create_arena(self, capacity: int, meta_capacity: int, cancel: Any = None) -> Any:
        return native().Arena.create(str(self.arena_path), self.num_slots, capacity,
                                     meta_capacity, self.chunk_bytes, self.job, True, cancel)

    def arena_ready(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout`` s) for a background arena set-up; True when none runs.

        The next boundary then adopts the arena and snapshots again.
        """
        return self._prep.wait(timeout)

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
        self._stats["arena_regrowths"] += 1
        return True

    def _adopt(self, arena: Any) -> Any:
        if arena.writable:
            arena.claim_owner()  # `cudasnap gc` must see this process as the live user
        if self._cuda is not None:
            return self._cuda.prepare_arena(arena, self, self._prep.fallback_reason)
        return arena

    # ---------------------------------------------------------- boundary
    def boundary(self, step: int, **values: Any) -> None:
        """Snapshot the state after ``step``'s optimizer step; returns at once.

        ``values``: plain per-step state (JSON-able values, tensors) saved with the
        step and found in ``snap.values`` after a restore (cudasnap.core.values).

        ``step`` is a non-negative int, strictly above the previous boundary's step
        or, after ``restore_latest()``/``rollback()``, above the restored step;
        anything else raises ConfigError naming both steps (see cudasnap.timeline).
        """
        t0 = time.perf_counter_ns()
        if self._closed:
            raise SnapshotError("boundary() on a closed Snapshotter")
        step = check_step(step, self.last_step, self._restored)
        self._restored = None
        self._boundaries += 1
        self.last_step = step
        self._live_dirty = False  # set again by the next optimizer step / buffer forward
        self.state.step_values = values
        try:
            self._snapshot(step, t0)
        finally:
            # After the submit: a SIGTERM flush raised here waits for this very step.
            if self.guard is not None:
                self.guard.on_boundary(step)

    def _snapshot(self, step: int, t0: int) -> None:
        k = self.snapshot_every
        if k > 1 and (self._boundaries - 1) % k:
            # Zero-overhead mode: no copy. Until the next optimizer step the live
            # state IS this step, so a JIT flush copies it then (see flush()).
            self._stats["skipped_every"] += 1
            self._live = (step, self._host_suffix(step))
            self._record_ns(t0)
            return
        self._live = None
        # A previous copy still running (no optimizer step in between): bounded.
        if not self._wait_job(self.wait_timeout_s):
            self._stats["skipped"] += 1
            log.warning("step %d not snapshotted: the previous copy is still running after "
                        "%.0f s", step, self.wait_timeout_s)
            return
        lay = self._current_layout()
        if self._submit_copy(lay, step, self._host_suffix(step)) is not None:
            self._record_ns(t0)

    def _host_suffix(self, step: int) -> bytes:
        """The per-boundary end of the slot manifest: host state + step."""
        return b"".join((self.state.encode_host(step).encode(), b',"step":',
                         str(int(step)).encode(), b"}"))

    def _submit_copy(self, lay: _Layout, step: int, suffix: bytes) -> Any:
        """Hands one snapshot to the copy engine; returns the job (None: skipped)."""
        arena = self._ensure_arena(lay.plan, lay.prefix_len + len(suffix))
        if arena is None:
            self._stats["skipped"] += 1
            return None
        with self._slot_lock:  # held only to pick the slot (never across CUDA calls)
            slot = arena.pick_write_slot()
        if slot < 0:
            self._stats["skipped"] += 1
            log.warning("step %d not snapshotted: every slot is busy (flush in progress)", step)
            return None
        stream = self._cuda.current_stream() if self._cuda is not None else 0
        try:
            # begin_write() inside refuses a slot a concurrent flush leased since
            # the pick (the arena's own lock orders the two): StagingError.
            job = self._engine.submit(arena, slot, lay.plan, int(step), suffix, stream,
                                      lay.prefix)  # positional: (meta suffix, stream, prefix)
        except StagingError as e:
            self._stats["skipped"] += 1
            log.warning("step %d not snapshotted: %s", step, e)
            return None
        with self._slot_lock:
            self._fenced = [False, False]
            self._job = job
            self._job_layout = lay
        self._stats["snapshots"] += 1
        self._stats["bytes"] = lay.plan.total_bytes
        return job

    def _record_ns(self, t0: int) -> None:
        ns = self._stats["boundary_ns"]
        ns.append(time.perf_counter_ns() - t0)
        if len(ns) > 4096:
            del ns[:2048]

    def _wait_job(self, timeout: float | None = None) -> bool:
        job = self._job
        if job is None:
            return True
        t0 = time.perf_counter_ns()
        try:
            ok = job.wait(1, -1.0 if timeout is None else timeout)
        except SnapshotError as e:
            log.error("snapshot of step %d failed: %s", job.step, e)
            ok = True
        self._stats["fence_wait_ns"] += time.perf_counter_ns() - t0
        if ok:
            secs = job.seconds_to_complete
            self._stats["last_copy_seconds"] = secs
            if secs and secs > 0:
                self._stats["last_copy_gbps"] = job.bytes / secs / 1e9
            # Another thread (a flush) may wait too: retire only the job we waited on.
            with self._slot_lock:
                if self._job is job:
                    self._job = None
                    self._job_layout = None
                    self._fenced = [True, True]
        return ok

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the running snapshot is COMPLETE (True) or the timeout passes."""
        return self._wait_job(timeout)

    # -------------------------------------------------------------- flush
    def flush(self, wait: bool = True, timeout: float | None = 30.0) -> Path | None:
        """Writes the newest COMPLETE snapshot to disk now; returns its directory.

        With ``wait`` the running copy (if any) is given ``timeout`` seconds to
        complete first, so the flushed step is the newest one. Returns None when
        no snapshot exists yet.
        """
        if self._closed:
            raise SnapshotError("flush() on a closed Snapshotter")
        with self._flush_lock, (self.guard.paused() if self.guard is not None else contextlib.nullcontext()):
            if wait:
                self._wait_job(timeout)
            if self._live is not None:
                self._copy_live(timeout)
            if self.dist is not None:
                path = self.dist.flush()
                if path is not None:
                    self._stats["flushes"] += 1
                    self._stats["last_flush_path"] = str(path)
                    self._stats["last_flush_seconds"] = self.dist.last_flush["seconds"]
                return path
            arena = self._arena or self._inherited
            if arena is None:
                log.warning("flush requested before the first snapshot: nothing to write")
                return None
            with self._slot_lock:
                slot = arena.newest_complete()
                if slot < 0:
                    log.warning("flush requested but no COMPLETE snapshot exists yet")
                    return None
                arena.lease(slot)
            try:
                nbytes = arena.slot_info(slot)["data_bytes"]
                with io_progress(nbytes, f"cudasnap flush step {arena.slot_info(slot)['step']}"):
                    path, st = self.storage.write_slot(arena, slot, threads=self.flush_threads,
                                                       keep=self.keep)
            finally:
                arena.release(slot)
            self._stats["flushes"] += 1
            self._flushed_step = int(st["step"])
            self._stats["last_flush_seconds"] = st["seconds"]
            self._stats["last_flush_path"] = str(path)
            return path

    def _copy_live(self, timeout: float | None) -> None:
        """Zero-overhead mode: the newest boundary was not copied; when no optimizer
        step (nor buffer forward, fence, load) ran since, the live tensors still hold
        that step, so copy them into a free slot now (same manifest, format and
        commit path) for the flush to write. Otherwise the newest COMPLETE slot is
        flushed (replay <= snapshot_every steps)."""
        live, arena = self._live, self._arena
        if live is None or arena is None or self._engine is None or self._live_copy is not None:
            return  # (not re-entered: a regrowth inside the copy flushes too)
        step, suffix = live
        ev = threading.Event()
        self._live_copy = ev  # set before reading the flag; _fence sets it the other way
        try:
            if self._live_dirty or self._live is not live:
                log.info("JIT flush: the state moved past step %d (optimizer step since); "
                         "flushing the newest copied snapshot", step)
                return
            if not self._wait_job(timeout):
                return
            try:
                lay = self._current_layout()
            except SnapshotError as e:
                log.warning("JIT flush: live state of step %d not copied: %s", step, e)
                return
            job = self._submit_copy(lay, step, suffix)
            if job is None or not self._wait_job(timeout if timeout is not None else
                                                 self.wait_timeout_s):
                return
            if self._live is live:
                self._live = None
            self._stats["live_saves"] += 1
            log.info("JIT flush: copied the live state of step %d (not snapshotted at its "
                     "boundary, snapshot_every=%d)", step, self.snapshot_every)
        finally:
            self._live_copy = None
            ev.set()

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
        self._wait_job(self.wait_timeout_s)
        t0 = time.perf_counter()
        if self.dist is not None:
            nxt = self.dist.restore()
            if nxt:
                self._restored = nxt - 1
            r = self._stats.get("restore") or {}
            r["seconds"] = time.perf_counter() - t0
            self._stats["restore"] = r if nxt else {"source": None, "step": None,
                                                    "seconds": r["seconds"], "where": None}
            self._layout = None
            if nxt:
                log.info("rank %d restored step %d from %s", self.rank, nxt - 1, r.get("source"))
                if not self._resume_logged:
                    self._resume_logged = True
                    log.warning("rank %d: %s", self.rank,
                                resume_message(nxt - 1, r.get("source"), r.get("where")))
            return nxt
        candidates: list[tuple[int, int, str, Any]] = []
        self._partly_applied = None
        arena = self._arena or self._inherited
        if arena is not None:
            for slot in range(arena.num_slots):  # every COMPLETE slot: the older one too
                info = arena.slot_info(slot)
                if info["valid"]:
                    candidates.append((info["step"], 1 + info["seq"], "shm", slot))
                elif info["problem"]:  # COMPLETE-looking but damaged: say so, never load it
                    log.warning("skipping snapshot %s slot %d: %s", arena.path, slot,
                                info["problem"])
        for s in self.storage.list_snapshots():
            candidates.append((s.step, 0, "disk", s))
        candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
        for _step, _, source, ref in candidates:
            try:
                if source == "shm":
                    where = f"{arena.path} slot {ref}"
                    got = self._restore_from_slot(arena, ref, where)
                else:
                    where = str(ref.path)
                    got = self._restore_from_dir(ref)
            except CorruptSnapshot as e:
                log.warning("skipping snapshot %s: %s", where, e)
                continue
            secs = time.perf_counter() - t0
            self._stats["restore"] = {"source": source, "step": got, "seconds": secs,
                                      "where": where}
            log.info("restored step %d from %s (%s) in %.3f s", got, source, where, secs)
            if not self._resume_logged:
                self._resume_logged = True
                log.warning("%s", resume_message(got, source, where))
            self._restored = got
            self._layout = None
            return got + 1
        self._stats["restore"] = {"source": None, "step": None, "seconds": 0.0, "where": None}
        if self._partly_applied:
            raise CorruptSnapshot(
                f"no snapshot could be restored, and {self._partly_applied} failed half-way "
                "through being applied: the live model/optimizer are no longer in their "
                "initial state; remove that snapshot and rebuild them before training")
        return 0

    def _apply(self, tensors: Any, host: Any, data: Any, where: str) -> int:
        """state.apply, with a malformed (CRC-consistent but hostile) host state reported
        as CorruptSnapshot instead of a raw KeyError/TypeError crashing restore."""
        self._live = None  # the live state is about to be replaced: no JIT copy of it
        try:
            return self.state.apply(tensors, host, data, where)
        except SnapshotError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
            self._partly_applied = where
            raise CorruptSnapshot(
                f"{where}: malformed snapshot state ({type(e).__name__}: {e})") from e

    def _restore_from_dir(self, ref: Any) -> int:
        """``ref``: a snapshot of ``self.storage``'s listing, or a local step/rank directory."""
        if isinstance(ref, Path):
            ref = posix.StoredSnapshot(-1, ref)
        if isinstance(ref, posix.StoredSnapshot) and not (ref.path / paths.MANIFEST).exists() \
                and any(ref.path.glob("rank-*")):
            ref = posix.StoredSnapshot(ref.step, self._single_rank_view(ref.path))
        manifest = self.storage.load_manifest(ref, allow_foreign_owner=self.allow_foreign_owner)
        name = str(ref.path).rstrip("/").rsplit("/", 1)[-1]
        with io_progress(int(manifest["data"]["bytes"]), f"cudasnap restore {name}", "read"):
            data = self.storage.read_data(ref, manifest, self.flush_threads,
                                          allow_foreign_owner=self.allow_foreign_owner)
        return self._apply(manifest["tensors"], manifest["host"], data, str(ref.path))

    def _single_rank_view(self, step_dir: Path) -> Path:
        """A multi-rank snapshot opened by one process: only replicated state loads."""
        from .format.paths import rank_dirname
        from .storage.posix import read_commit

        if not posix.is_committed(step_dir):
            raise CorruptSnapshot(f"{step_dir}: multi-rank snapshot without a COMMIT marker")
        commit = read_commit(step_dir)
        groups = commit.get("replica_groups") or []
        if len(groups) != 1:
            raise IncompatibleSnapshot(
                f"{step_dir} holds sharded state of {commit['world_size']} ranks; restore it with "
                f"torch.distributed and {commit['world_size']} ranks")
        for r in commit.get("present", range(commit["world_size"])):
            d = step_dir / rank_dirname(int(r))
            if (d / paths.MANIFEST).is_file():
                return d
        raise CorruptSnapshot(f"{step_dir}: no rank's files are present")

    def _restore_from_slot(self, arena: Any, slot: int, where: str) -> int:

        info = arena.slot_info(slot)
        meta = fmt.parse_slot_meta(arena.read_meta(slot), where)
        meta["data"] = fmt.data_section(info["data_bytes"], arena.chunk_bytes,
                                        arena.read_table(slot))
        validate_manifest(meta, where)
        C = native()
        bad = C.verify_buffer(arena.data_ptr(slot), info["data_bytes"], arena.chunk_bytes,
                              meta["data"]["crc32c"], self.flush_threads)
        if bad >= 0:
            raise CorruptSnapshot(f"{where}: chunk {bad} fails its CRC32C")
        arena.lease(slot)
        try:
            data = torch.frombuffer(arena.data_view(slot, info["data_bytes"]), dtype=torch.uint8) \
                if info["data_bytes"] else torch.empty(0, dtype=torch.uint8)
            return self._apply(meta["tensors"], meta["host"], data, where)
        finally:
            arena.release(slot)

    @property
    def values(self) -> dict[str, Any]:
        """The ``boundary(step, **values)`` of the restored step ({} before a restore)."""
        return self.state.values

    def newest_known_step(self) -> int:
        """Newest step in shared memory or on disk, or -1 (no validation of the data)."""
        best = -1
        for a in (self._arena, self._inherited):
            if a is not None and a.newest_complete() >= 0:
                best = max(best, a.slot_info(a.newest_complete())["step"])
        snaps = self.storage.list_snapshots()
        return max(best, snaps[0].step if snaps else -1)

    def rollback(self) -> int:
        """In-process rollback: copy the newest COMPLETE slot back into the live tensors.

        For a fault the process survives (a NaN loss, a peer failure): training
        continues at the returned step (snapshot step + 1).
        """
        if self._closed:
            raise SnapshotError("rollback() on a closed Snapshotter")
        self._wait_job(self.wait_timeout_s)
        arena = self._arena
        if arena is None or arena.newest_complete() < 0:
            raise SnapshotError("rollback(): no COMPLETE snapshot in memory yet")
        slot = arena.newest_complete()
        with self.guard.paused() if self.guard is not None else contextlib.nullcontext():
            step = self._restore_from_slot(arena, slot, f"{arena.path} slot {slot}")
        self._restored = step
        return step + 1

    # -------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """Counters: snapshots, skipped, bytes, boundary time (median us), copy GB/s, flushes."""
        s = dict(self._stats)
        ns = sorted(s.pop("boundary_ns"))
        s["boundary_us_median"] = ns[len(ns) // 2] / 1e3 if ns else None
        s["fence_wait_s"] = s.pop("fence_wait_ns") / 1e9
        s["backend"] = getattr(self, "backend", None)
        a = self._arena or self._inherited
        s["staging"] = None if a is None else {
            "path": a.path, "bytes": a.total_bytes, "shared": a.shared,
            "page_locked": a.cuda_registered, "huge_pages": a.huge_pages,
            # Why the arena is process-private (cudaHostRegister of the shared file refused).
            "fallback_reason": self._prep.fallback_reason or (
                self._cuda.fallback_reason if self._cuda is not None else None)}
        s["arena_preparing"] = self._prep.busy
        if self.guard is not None:
            s["health_events"] = len(self.guard.history())
        s.update(arena_slots(self._arena or self._inherited, self.num_slots, self.spare_slot))
        return s

    def coverage(self) -> dict[str, Any]:
        """Live device bytes vs bytes covered by the registered state (CUDA backend)."""
        if self._cuda is None:
            raise SnapshotError("coverage() needs the CUDA backend (state on a GPU)")
        lay = self._current_layout()
        return self._cuda.coverage(lay.tensors)

    def close(self, keep_arena: bool = False, flush: bool | None = None) -> None:
        """Waits for the running copy, flushes it (see ``flush_on_close``), stops threads
        and hooks, removes the arena (kept when ``keep_arena`` or when that flush failed)."""
        if self._closed:
            return
        arena_prep.shutdown(self, min(60.0, self.wait_timeout_s))  # a set-up in progress
        if flush is None:
            flush = self.flush_on_close and not keep_arena and self.dist is None
        if flush and not final_flush(self):
            keep_arena = True  # the arena holds the only copy of the final state
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
            if self._cuda is not None:
                self._cuda.close(self.wait_timeout_s)
            elif self._engine is not None and not self._engine.shutdown(self.wait_timeout_s):
                log.error("close(): the running snapshot copy was abandoned after %.0f s",
                          self.wait_timeout_s)
            for a in (self._arena, self._inherited):
                if a is not None and not keep_arena:
                    a.unlink()
            self._arena = self._inherited = None
            self._lock.release()

    def __enter__(self) -> "Snapshotter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.guard is not None:
            self.guard.on_exception(exc)
        # Keep the arena after a failure: the supervisor or the next process uses it.
        self.close(keep_arena=exc_type is not None)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
