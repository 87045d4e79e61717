"""The fields the Snapshotter's mechanisms share, declared once (typed), and its option checks.

``cudasnap.snapshotter.Snapshotter`` is assembled from one mixin per mechanism
(``fences``, ``layout``, ``staging``, ``submit``, ``flush``, ``restore``); each
reads and writes the fields below, which ``Snapshotter.__init__`` sets. Code
outside ``cudasnap.core`` and ``cudasnap.snapshotter`` uses the public methods
(or ``cudasnap.dist.local`` / ``cudasnap.core.timeline``'s narrow protocols),
never these fields.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..format.paths import is_url
from .rng import RNG_SOURCES

if TYPE_CHECKING:
    from .arena_prep import ArenaPreparer
    from .counters import Counters
    from .plan import Layout
    from .state import TrainingState


class Fields:
    """Typed declarations of the shared state (no behaviour)."""

    # what and where
    state: TrainingState
    storage: Any  # cudasnap.storage: a posix or fsspec reader/writer
    directory: Path
    rank: int
    world_size: int
    job: str
    arena_path: Path
    num_slots: int
    spare_slot: bool
    chunk_bytes: int
    keep: int
    copy_threads: int
    flush_threads: int
    allow_foreign_owner: bool | None
    wait_timeout_s: float
    snapshot_every: int
    backend: str
    # parts
    dist: Any
    guard: Any
    _backend_name: str
    _engine: Any
    _cuda: Any
    _arena: Any
    _inherited: Any
    _prep: ArenaPreparer
    _layout: Layout | None
    _job_layout: Layout | None  # the running copy's layout: it holds the planned storages
    _draining: tuple[Layout, ...]  # failed copies' layouts until the engine drained them
    _hooks: list[Any]
    _stats: Counters
    # copy / fence bookkeeping
    _job: Any
    _fenced: list[bool]
    _slot_lock: threading.RLock
    _flush_lock: threading.RLock
    _live: tuple[int, bytes] | None
    _live_dirty: bool
    _live_copy: threading.Event | None
    # before the arena is ready (cudasnap.core.early)
    _arena_lock: threading.RLock  # arena adoption/creation: ensure(), a synchronous snapshot
    _boundary_event: threading.Event | None  # set by the next boundary (a flush waits)
    _early_thread: int | None  # the thread of the last boundary skipped for want of an arena
    _early_saving: bool
    _supervised: bool  # under `cudasnap run` (its supervisor takes care of a left arena)
    # timeline
    last_step: int | None
    _restored: int | None
    _flushed_step: int | None
    _resume_logged: bool
    _partly_applied: str | None
    _boundaries: int
    _closed: bool

    # Implemented by the mechanism mixins (declared for the others' type checks).
    def _wait_job(self, timeout: float | None = None) -> bool: raise NotImplementedError
    def wait(self, timeout: float | None = None) -> bool: raise NotImplementedError
    def _fence(self, phase: int) -> None: raise NotImplementedError
    def _hold_draining(self, lay: Layout | None) -> None: raise NotImplementedError
    def _release_drained(self) -> None: raise NotImplementedError
    def _release_at_close(self, drained: bool) -> None: raise NotImplementedError
    def _current_layout(self) -> Layout: raise NotImplementedError
    def _ensure_engine(self, tensors: list[Any]) -> None: raise NotImplementedError
    def _ensure_arena(self, plan: Any, meta_len: int) -> Any: raise NotImplementedError
    def _submit_copy(self, lay: Layout, step: int, suffix: bytes) -> Any:
        raise NotImplementedError
    def flush(self, wait: bool = True, timeout: float | None = 30.0) -> Path | None:
        raise NotImplementedError
    def invalidate_layout(self) -> None: raise NotImplementedError
    def staged_arenas(self) -> list[Any]: raise NotImplementedError


def check_options(*, num_slots: int, spare_slot: bool, keep: Any, chunk_bytes: int,
                  backend: str, snapshot_every: Any, rng_sources: tuple[str, ...]) -> None:
    """Raises ConfigError naming the first bad constructor argument."""
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) \
            or snapshot_every < 1:
        raise ConfigError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
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
    bad = set(rng_sources) - set(RNG_SOURCES)
    if bad:
        raise ConfigError(f"unknown rng_sources {sorted(bad)}; use torch, cuda, numpy, python")


def check_url(directory: Any, world_size: int, fresh: bool) -> None:
    """An object-store URL is never moved aside: ``fresh`` is refused (any world size).

    Why refuse rather than move: an object store has no rename, so "aside" would be a
    copy of every object under ``.old-<time>/`` and a delete of the originals, one
    object at a time: minutes for a large snapshot, and a start killed half-way leaves
    the old steps half copied and half deleted (a COMMIT may survive its data; restore
    would skip such a step, but the old snapshots would not be kept whole as fresh
    promises). The fresh start (core.timeline.move_aside) also moves local files only. A
    new URL prefix is a fresh start that costs nothing and loses nothing.
    Multi-rank jobs are supported (cudasnap.storage.remote_ranks)."""
    if is_url(directory) and fresh:
        raise ConfigError(f"{directory}: fresh=True (CUDASNAP_FRESH, cudasnap run --fresh) "
                          "cannot move object-store snapshots aside (no rename in an object "
                          "store); start fresh under a new URL prefix instead, e.g. "
                          f"{str(directory).rstrip('/')}-2")
