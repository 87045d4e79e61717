"""What the coordinator needs of this rank's local snapshots: the ``LocalSnapshots`` protocol.

The coordinator (``cudasnap.distributed``) never imports the Snapshotter nor calls it. It
reads and drives this rank's snapshots only through this protocol; the Snapshotter passes
a ``ComponentsLocal`` (below) made of its components, the one place that knows which
component holds the arenas and how a slot or a directory is applied.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import FLUSH_WAIT_S
from ..format import paths

if TYPE_CHECKING:  # the stub only: no extension is loaded by importing this module
    from cudasnap._C import Arena

    from ..storage.protocol import Storage


def complete_steps(arenas: list[Arena]) -> list[int]:
    """Steps COMPLETE in ``arenas``, newest first."""
    out = {int(a.slot_info(i)["step"]) for a in arenas for i in range(a.num_slots)
           if a.slot_info(i)["valid"]}
    return sorted(out, reverse=True)


def empty_newer(arena: Arena, step: int) -> int:
    """Empties the COMPLETE slots of ``arena`` newer than ``step``; returns how many."""
    n = 0
    for i in range(arena.num_slots):
        info = arena.slot_info(i)
        if info["valid"] and int(info["step"]) > step:
            arena.invalidate(i)
            n += 1
    return n


class LocalSnapshots(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def job(self) -> str: ...
    @property
    def directory(self) -> Path: ...
    @property
    def storage(self) -> Storage:
        """Where this rank's part of a round and the COMMIT go (the Snapshotter's)."""
    @property
    def keep(self) -> int: ...
    @property
    def flush_threads(self) -> int: ...

    def arenas(self) -> list[Arena]:
        """This rank's open arenas: its own, then one inherited from a predecessor."""

    def arena_path_of(self, rank: int) -> Path:
        """Where ``rank`` of this job keeps its arena on this host."""

    def last_step(self) -> int | None:
        """The step of the newest boundary() (None before the first)."""

    def replicated(self) -> bool:
        """True when the state is replicated on every rank (e.g. a DDP model)."""

    def request_flush(self) -> None:
        """Start this rank's (coordinated) flush without waiting for it."""

    def peer_failure(self, detail: str) -> None:
        """Peers died: route through the trigger policy, or flush."""

    def settle_newest(self, timeout: float) -> None:
        """Make the newest boundary COMPLETE in the arena when it was not copied
        (zero-overhead mode, ``snapshot_every`` > 1) and the state has not moved since."""

    def restore_from_slot(self, arena: Arena, slot: int, where: str) -> int:
        """Apply a slot; returns the restored step."""

    def restore_from_dir(self, path: Path) -> int:
        """Apply a rank directory's files; returns the restored step."""

    def record_restore(self, source: str, step: int, where: str) -> None:
        """Note where the restore came from (stats)."""

    def restore_source(self) -> str | None:
        """The source recorded by the last record_restore (None if none)."""

    def attach(self, guard: Any) -> None:
        """The guard, once made (None: none): a peer's failure goes through it."""


class ComponentsLocal:
    """``LocalSnapshots`` over the Snapshotter's components (cudasnap.core.wiring), not the
    facade: the coordinator's calls (a flush round's ``settle_newest`` while the flush lock
    is held, a restore's ``restore_from_slot``) go down to the component that does the
    work, never back up through the Snapshotter."""

    def __init__(self, opts: Any, state: Any, directory: Path, timeline: Any, keeper: Any,
                 flusher: Any, restorer: Any, early: Any) -> None:
        self._o, self._state, self._dir = opts, state, Path(directory)
        self._timeline, self._keeper, self._flusher = timeline, keeper, flusher
        self._restorer, self._early = restorer, early
        self._guard: Any = None

    def attach(self, guard: Any) -> None:
        """The guard, once made (a peer's failure goes through it: its policy decides)."""
        self._guard = guard

    @property
    def rank(self) -> int:
        return int(self._o.dist.rank)

    @property
    def world_size(self) -> int:
        return int(self._o.dist.world_size)

    @property
    def job(self) -> str:
        return str(self._o.arena.job)

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def storage(self) -> Storage:
        storage: Storage = self._flusher.storage
        return storage

    @property
    def keep(self) -> int:
        return int(self._o.flush.keep)

    @property
    def flush_threads(self) -> int:
        return int(self._o.flush.threads)

    def arenas(self) -> list[Arena]:
        arenas: list[Arena] = self._keeper.staged_arenas()
        return arenas

    def arena_path_of(self, rank: int) -> Path:
        return paths.arena_path(Path(self._o.arena.path).parent, self.job, rank)

    def last_step(self) -> int | None:
        step: int | None = self._timeline.last_step
        return step

    def replicated(self) -> bool:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return any(isinstance(m, DDP) for m in self._state.models.values())

    def request_flush(self) -> None:
        self._early.before_flush(FLUSH_WAIT_S)  # as the Snapshotter's flush() does
        self._flusher.flush(False, FLUSH_WAIT_S)

    def peer_failure(self, detail: str) -> None:
        if self._guard is not None:
            self._guard.trigger("peer_failure", detail)
        else:
            self.request_flush()

    def settle_newest(self, timeout: float) -> None:
        self._flusher.settle_newest(timeout)

    def restore_from_slot(self, arena: Arena, slot: int, where: str) -> int:
        step: int = self._restorer.restore_slot(arena, slot, where)
        return step

    def restore_from_dir(self, path: Path) -> int:
        step: int = self._restorer.restore_dir(path)
        return step

    def record_restore(self, source: str, step: int, where: str) -> None:
        self._restorer.record_restore(source, step, where)

    def restore_source(self) -> str | None:
        src: str | None = (self._restorer.last_restore() or {}).get("source")
        return src
