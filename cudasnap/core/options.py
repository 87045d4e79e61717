"""Options: every Snapshotter option resolved once (keywords over the environment), checked.

The facade calls :meth:`Options.resolve` first, before anything is made: each keyword is
checked (``config.check_options``: one ConfigError naming the first bad one), each unset
keyword takes its variable (``config.Settings``), each "auto" is resolved here once (the
thread counts, the arena's slot count with the spare and parity slots, the job id), and
the result is frozen, in groups: ``arena``, ``copy``, ``flush``, ``health``, ``dist`` and
``waits``. ``core.wiring.wire`` hands the components what they need of it; defaults live
in ``cudasnap.config`` (its tables and constants), nowhere else.

:class:`Waits` is every wait bound derived from ``CUDASNAP_WAIT_S`` (``wait_s``): the bound
of a wait on a copy, and the shorter one of ``close()`` and a cancelled set-up.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import config as cfg
from ..config import Settings
from ..format import paths

log = logging.getLogger("cudasnap")


@dataclass(frozen=True)
class Waits:
    copy_s: float  # every wait on a copy: fences, submit, a flush's, a regrowth's (CUDASNAP_WAIT_S)

    @property
    def close_s(self) -> float:
        """``close()`` and a set-up's cancel: never more than a minute."""
        return min(60.0, self.copy_s)


@dataclass(frozen=True)
class ArenaOptions:
    """The staging arena in /dev/shm."""
    num_slots: int  # as asked (>= 2): one COMPLETE while the next is WRITING
    spare_slot: bool
    slots: int  # the arena's slots in all: num_slots + the spare + XOR parity's leased one
    chunk_bytes: int | None  # None: follows the state (core.slot_geometry)
    sync_max_bytes: int  # arenas up to this size are made on the training thread
    device_staging: int | str  # bytes of the device buffer, or "auto" (0: off)
    job: str
    path: Path


@dataclass(frozen=True)
class CopyOptions:
    """The copy engine and what each boundary's snapshot holds."""
    backend: str  # "auto", "cpu" or "cuda" (auto: resolved at the first boundary, Backend)
    threads: int
    snapshot_every: int | None  # None: the overhead budget's k (core.cadence)
    overhead_budget: float | None  # None: auto
    rng_sources: tuple[str, ...]
    rng_restore: str  # cfg.RNG_RESTORE_POINTS (core.rng.RestoredRng)


@dataclass(frozen=True)
class FlushOptions:
    """The flusher and the restore from disk."""
    threads: int
    keep: int  # committed snapshots kept (0: all)
    on_close: bool  # close() flushes the newest snapshot
    fresh: bool  # start over: existing snapshots moved aside
    require_resume: bool  # never with fresh
    allow_foreign_owner: bool


@dataclass(frozen=True)
class HealthOptions:
    """The guard: health monitor, signals, watchdog (cudasnap.triggers.guard)."""
    on: bool
    watchdog_s: float | None  # None: no watchdog
    poll_s: float  # NVML poll interval
    inject: str | None  # scripted faults instead of NVML
    policy: str | None  # trigger policy overrides (triggers.policy.Policy.parse)
    first_of_job: bool  # rank 0 of the first attempt (says "NVML unavailable" above DEBUG)


@dataclass(frozen=True)
class DistOptions:
    """This process among the job's ranks."""
    rank: int
    world_size: int
    supervised: bool  # under ``cudasnap run``


@dataclass(frozen=True)
class Options:
    arena: ArenaOptions
    copy: CopyOptions
    flush: FlushOptions
    health: HealthOptions
    dist: DistOptions
    waits: Waits

    @classmethod
    def resolve(cls, env: Settings, *, directory: str | os.PathLike[str],
                open_dir: Callable[[], Path], rank: int, world_size: int,
                num_slots: int = cfg.NUM_SLOTS, spare_slot: bool = True,
                chunk_bytes: int | None = None, keep: int = cfg.KEEP, backend: str = "auto",
                copy_threads: int | None = None, flush_threads: int | None = None,
                snapshot_every: int | None = None, overhead_budget: float | None = None,
                device_staging: int | str | None = None,
                arena_sync_max_bytes: int | None = None,
                allow_foreign_owner: bool | None = None, fresh: bool | None = None,
                require_resume: bool | None = None, flush_on_close: bool = True,
                rng_sources: tuple[str, ...] = cfg.RNG_SOURCES, rng_restore: str | None = None,
                node_replica: bool | str | None = None, shm_dir: str | os.PathLike[str] | None = None,
                job: str | None = None, health: bool | None = None,
                watchdog_s: float | None = None, inject: str | None = None) -> Options:
        """The options of a Snapshotter; keywords None take the environment's value, then
        the default. ConfigError names the first bad value, raised before anything is made:
        only then ``open_dir()`` opens the storage of ``directory`` (a path or an fsspec
        URL) and returns its local directory (the job id is that directory's)."""
        cfg.check_options(num_slots=num_slots, spare_slot=spare_slot, keep=keep,
                          chunk_bytes=chunk_bytes, backend=backend, snapshot_every=snapshot_every,
                          rng_sources=rng_sources, overhead_budget=overhead_budget,
                          device_staging=device_staging)
        if rng_restore is not None:
            cfg.check_rng_restore(rng_restore, "rng_restore")
        fresh = env.fresh if fresh is None else bool(fresh)
        cfg.check_fresh_url(directory, paths.is_url(directory), fresh)
        slots = cfg.arena_slots(num_slots, spare_slot, world_size, node_replica, env.node_parity)
        local = open_dir()
        copy_n, flush_n = cfg.resolve_threads(copy_threads, flush_threads)
        shm = Path(shm_dir) if shm_dir else env.shm_dir
        # The arena name carries the directory's identity (cudasnap.format.paths).
        job = job or supervisor_job(env.job, env.directory, env.supervised,
                                    local) or paths.snapshotter_job(local, shm)
        require = env.require_resume if require_resume is None else bool(require_resume)
        sync = env.arena_sync_max_bytes if arena_sync_max_bytes is None else arena_sync_max_bytes
        return cls(
            arena=ArenaOptions(
                num_slots=num_slots, spare_slot=bool(spare_slot), slots=slots,
                chunk_bytes=chunk_bytes,
                sync_max_bytes=cfg.ARENA_SYNC_MAX_BYTES if sync is None else sync,
                device_staging=env.device_staging if device_staging is None else device_staging,
                job=job, path=paths.arena_path(shm, job, rank)),
            copy=CopyOptions(
                backend=backend, threads=copy_n, snapshot_every=snapshot_every,
                overhead_budget=env.overhead_budget if overhead_budget is None
                else float(overhead_budget),
                rng_sources=tuple(rng_sources),
                rng_restore=env.rng_restore if rng_restore is None else rng_restore),
            flush=FlushOptions(
                threads=flush_n, keep=keep, on_close=flush_on_close, fresh=fresh,
                require_resume=require and not fresh,
                allow_foreign_owner=env.allow_foreign_owner if allow_foreign_owner is None
                else bool(allow_foreign_owner)),
            health=HealthOptions(
                on=bool(env.health) if health is None else bool(health),
                watchdog_s=env.watchdog_s if watchdog_s is None else watchdog_s,
                poll_s=env.poll_s, inject=env.inject if inject is None else inject,
                policy=env.policy, first_of_job=env.first_of_job),
            dist=DistOptions(rank=rank, world_size=world_size, supervised=env.supervised),
            waits=Waits(env.wait_s))


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
