"""A rank's directory of a step, written from a slot of shared memory: this rank's own
arena, a dead host mate's arena, or a copy this node holds of a lost node's rank (steps 2
of the round in cudasnap.distributed.flush_round; held copies: cudasnap.distributed.held_copies)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .._native import native
from ..errors import SnapshotError
from ..storage.protocol import Storage
from .kv import KV
from .liveness import Liveness
from .local import LocalSnapshots

if TYPE_CHECKING:  # the stub only: no extension is loaded by importing this module
    from cudasnap._C import Arena

    from .held_copies import HeldCopies

log = logging.getLogger("cudasnap.distributed")


def write_slot(store: Storage, arena: Arena, rank: int, step: int, threads: int,
               replica_group: list[int]) -> Path | None:
    """Writes ``rank``'s slot of ``step`` in ``arena`` to ``store``, the slot leased while it
    is read; None (logged) when the slot is not there or the write fails."""
    slot = -1
    for i in range(arena.num_slots):
        if arena.slot_info(i)["valid"] and arena.slot_info(i)["step"] == step:
            arena.lease(i)  # then check again: a copy may have claimed it meanwhile
            info = arena.slot_info(i)
            if info["valid"] and info["step"] == step:
                slot = i
                break
            arena.release(i)
    if slot < 0:
        log.error("rank %d: step %d is not in shared memory (%s)", rank, step, arena.path)
        return None
    try:
        # Files of this rank for an uncommitted step are a failed round's: rewritten.
        store.clear_stale(step, rank)
        return store.write_rank(arena, slot, rank, threads=threads,
                                extra_manifest={"replica_group": replica_group})
    except SnapshotError as e:
        log.error("rank %d: writing step %d failed: %s", rank, step, e)
        return None
    finally:
        arena.release(slot)


class RankFiles:
    """Writes rank directories of a round's step: this rank's, and the dead ranks' this
    rank is the claimed writer of (``{g}/writer/<rank>``: one writer per directory)."""

    def __init__(self, store: Storage, kv: KV, live: Liveness, local: LocalSnapshots,
                 copies: HeldCopies | None, replicas_of: Callable[[int], list[int]]) -> None:
        self.store, self.kv, self.live, self.local = store, kv, live, local
        self.copies, self.replicas_of = copies, replicas_of
        self.rank = live.rank

    def write(self, rank: int, step: int, arena: Arena | None) -> Path | None:
        """Writes ``rank``'s slot of ``step``; None (logged) when it cannot."""
        return None if arena is None else write_slot(
            self.store, arena, rank, step, self.local.flush_threads, self.replicas_of(rank))

    def write_dead(self, step: int, g: str, dead: set[int]) -> None:
        """The arenas ranks of D left on this host (the lowest live rank there writes
        them), and the dead ranks whose copies this node holds (where this rank's offer
        won); each one's ``done`` marker set."""
        live = self.live
        for r in sorted(dead):
            if r == self.rank or r in live.closed:
                continue
            held = self.copies.published(g, r) if self.copies is not None else None
            mine = live.host_of(r) == live.host and live.live_host_mate(r, dead) == self.rank
            if not (mine or held is not None and held[0] == self.rank) \
                    or self.kv.propose(f"{g}/writer/{r}", str(self.rank)) != str(self.rank):
                continue
            if mine:
                got = self._write_left(r, step)
            else:
                got = self.copies.write(g, r, step, self.write) if self.copies else None
            self.kv.set(f"{g}/done/{r}", "ok" if got else "missing")

    def _write_left(self, r: int, step: int) -> Path | None:
        path = self.local.arena_path_of(r)
        try:
            if not path.exists():
                log.error("dead rank %d left no arena (%s)", r, path)
                return None
            got = self.write(r, step, native().Arena.open(str(path), True))
            log.warning("rank %d flushed dead rank %d's arena for step %d", self.rank, r, step)
            return got
        except SnapshotError as e:
            log.error("cannot flush dead rank %d's arena %s: %s", r, path, e)
            return None
