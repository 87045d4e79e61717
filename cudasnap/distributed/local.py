"""What the coordinator needs of this rank's local snapshots: the ``LocalSnapshots`` protocol.

The coordinator (``cudasnap.distributed``) never imports the Snapshotter. It reads
and drives this rank's snapshots only through this protocol; the Snapshotter
passes a ``SnapshotterLocal`` adapter (below), the one place that knows which
Snapshotter fields hold the arenas and how a slot or a directory is applied.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..format import paths

if TYPE_CHECKING:  # the stub only: no extension is loaded by importing this module
    from cudasnap._C import Arena


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


class SnapshotterLocal:
    """``LocalSnapshots`` over a Snapshotter (typed loosely: no import of it, no cycle).

    Uses only the Snapshotter's public attributes and methods (``staged_arenas``,
    ``restore_slot``, ``restore_dir``, ``record_restore``, ``last_restore``), never
    its private fields."""

    def __init__(self, snap: Any) -> None:
        self._s = snap

    @property
    def rank(self) -> int:
        return int(self._s.rank)

    @property
    def world_size(self) -> int:
        return int(self._s.world_size)

    @property
    def job(self) -> str:
        return str(self._s.job)

    @property
    def directory(self) -> Path:
        return Path(self._s.directory)

    @property
    def keep(self) -> int:
        return int(self._s.keep)

    @property
    def flush_threads(self) -> int:
        return int(self._s.flush_threads)

    def arenas(self) -> list[Arena]:
        arenas: list[Arena] = self._s.staged_arenas()
        return arenas

    def arena_path_of(self, rank: int) -> Path:
        return paths.arena_path(Path(self._s.arena_path).parent, self.job, rank)

    def last_step(self) -> int | None:
        step: int | None = self._s.last_step
        return step

    def replicated(self) -> bool:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return any(isinstance(m, DDP) for m in self._s.state.models.values())

    def request_flush(self) -> None:
        self._s.flush(wait=False)

    def peer_failure(self, detail: str) -> None:
        if self._s.guard is not None:
            self._s.guard.trigger("peer_failure", detail)
        else:
            self._s.flush(wait=False)

    def settle_newest(self, timeout: float) -> None:
        self._s.settle_newest(timeout)

    def restore_from_slot(self, arena: Arena, slot: int, where: str) -> int:
        step: int = self._s.restore_slot(arena, slot, where)
        return step

    def restore_from_dir(self, path: Path) -> int:
        step: int = self._s.restore_dir(path)
        return step

    def record_restore(self, source: str, step: int, where: str) -> None:
        self._s.record_restore(source, step, where)

    def restore_source(self) -> str | None:
        src: str | None = (self._s.last_restore() or {}).get("source")
        return src
