"""Survivors commit for the dead: a flush round uses the copies of dead ranks this node holds.

With node-loss replication (cudasnap.distributed.replica) a node's shared memory holds copies of
other nodes' ranks: guest arenas, or own arenas of an earlier rank numbering. When a node
is lost, its ranks are dead in the survivors' flush round and no live rank shares their
host, so no one can read their arenas; but the node holding their copies can. In round
``g``:

  1. ``offer``: every live rank publishes, for each dead rank it holds copies of, the steps
     they hold: ``{g}/held/<dead> = <rank>;<steps>`` by compare-and-set (the first one
     stored wins, and that rank writes the dead rank's files); then, copies or none,
     ``{g}/looked/<dead>/<rank>``;
  2. the agreement counts the dead rank with those steps (``published``), and waits for
     the offer (``awaited``) until the rank its copies went to (its ring partner) looked
     or is dead too;
  3. the winner writes the dead rank's directory of the agreed step from the copy
     (``write``) and sets its ``done`` marker, as a live host mate does for an arena;
  4. the committer waits for that marker, then commits the step with every rank present,
     so a later loss of the holder too still restores the step from disk.

A copy is used only when it holds exactly the agreed step, checked chunk by chunk when it
landed (cudasnap.distributed.replica_wire.land) and by the slot protocol's commit.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .kv import KV, csv, parse_csv
from .replica import ring_partner
from .replica_store import find_slot, held_steps

if TYPE_CHECKING:
    from cudasnap._C import Arena

    from .replica import Replicator

log = logging.getLogger("cudasnap.distributed")


class HeldCopies:
    """The copies of other ranks' snapshots this node holds, as a flush round uses them."""

    def __init__(self, replica: Replicator, kv: KV, rank: int) -> None:
        self.replica, self.kv, self.rank = replica, kv, rank

    def offer(self, g: str, dead: int) -> None:
        """Publishes the steps of ``dead``'s copies held here (nothing when none)."""
        steps = held_steps(self.replica.shm, self.replica.job, self.replica.own_path).get(dead)
        if steps:
            won = self.kv.propose(f"{g}/held/{dead}", f"{self.rank};{csv(steps)}")
            if won.partition(";")[0] == str(self.rank):
                log.warning("rank %d holds copies of dead rank %d's steps %s; it writes the "
                            "rank's files of the agreed step", self.rank, dead, steps)
        self.kv.set(f"{g}/looked/{dead}/{self.rank}", csv(steps or ()))

    def published(self, g: str, dead: int) -> tuple[int, set[int]] | None:
        """(the holder that writes, the steps it holds) of ``dead`` in round ``g``."""
        v = self.kv.get(f"{g}/held/{dead}")
        if v is None:
            return None
        holder, _, steps = v.partition(";")
        return int(holder), parse_csv(steps)

    def awaited(self, g: str, dead: int, gone: set[int]) -> bool:
        """True while no offer for ``dead`` is published and the rank its copies went to
        (its ring partner), not in ``gone``, has not yet looked for them."""
        if self.published(g, dead) is not None:
            return False
        nodes = self.replica.nodes(0.0)
        if nodes is None or dead not in nodes:
            return False
        partner = ring_partner(nodes, dead)
        return partner is not None and partner not in gone \
            and self.kv.get(f"{g}/looked/{dead}/{partner}") is None

    def write(self, g: str, dead: int, step: int,
              flush: Callable[[int, int, Arena], Path | None]) -> Path | None:
        """Writes ``dead``'s directory of ``step`` from the copy held here, through
        ``flush(rank, step, arena)``; None (logged) when this rank is not the holder that
        won, or its copy of that step is gone."""
        won = self.published(g, dead)
        if won is None or won[0] != self.rank:
            return None
        found = find_slot(self.replica.shm, self.replica.job, dead, step, self.replica.own_path)
        if found is None:
            log.error("rank %d: the copy of dead rank %d's step %d is gone", self.rank, dead,
                      step)
            return None
        path = flush(dead, step, found[0])
        if path is not None:
            log.warning("rank %d wrote dead rank %d's step %d from the copy its node holds",
                        self.rank, dead, step)
        return path
