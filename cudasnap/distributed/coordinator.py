"""The distributed side of one rank's snapshots: wires the store client, liveness, rounds, vote.

The Coordinator knows this rank's snapshots only through ``LocalSnapshots``
(distributed/local.py). Two threads per rank: the peer monitor (heartbeats, peer
checks, noticing a round another rank requested) and an action thread that
runs what the monitor asks for (join a round, react to dead peers), so
heartbeats go on during a flush. Newly dead peers trigger ``peer_failure``
(default policy: flush, exit 79).
"""
from __future__ import annotations

import logging
import operator
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Settings, node_replica_mode
from ..errors import ConfigError, FlushError, exception_active
from .events import PROGRESS_EVERY_S, EventLog
from .flush_round import FlushRounds, RoundResult
from .kv import KV, store_is_per_round, store_lost, warn_if_restarts_share_the_store
from .liveness import Liveness
from .local import LocalSnapshots, empty_newer
from .restore_vote import RestoreVote

if TYPE_CHECKING:
    from .replica import Replicator

log = logging.getLogger("cudasnap.distributed")
# Coordinators made in this process, per process group and (job, epoch): a later one's store
# keys (_instance). Keyed weakly by the group object: a group made again (an in-process
# restart's next generation, cudasnap.distributed.inprocess) counts from 0 on every rank.
_INSTANCES: weakref.WeakKeyDictionary[object, dict[tuple[str, int], int]] = \
    weakref.WeakKeyDictionary()


def _instance(job: str, epoch: int) -> str:
    """The store-key part of this process's next Coordinator of ``job`` in ``epoch`` on the
    default process group: "" for the first (the keys it always had), ``i<n>/`` after it.
    A second Snapshotter of the job on the same group (one made again after a restore)
    must not read the first one's rounds: its round 0 found the first's agreed step in the
    store and committed that old step again, and close() took it for the final one. Every
    rank of a group makes its Snapshotters in the same order, so the count agrees."""
    import torch.distributed as dist

    counts = _INSTANCES.setdefault(dist.group.WORLD, {})
    n = counts.get((job, epoch), 0)
    counts[(job, epoch)] = n + 1
    return "" if n == 0 else f"i{n}/"


#: ``Snapshotter(replicas=...)``: "auto", "all"/True, None/False/"none", or rank groups
Replicas = str | bool | None | Iterable[Iterable[int]]


def replica_groups(replicas: Replicas, world: int, replicated: bool) -> list[list[int]]:
    """``replicas`` ("auto", "all"/True, None/False/"none", or groups) as a partition of ranks."""
    if replicas == "auto":
        return [list(range(world))] if replicated else [[r] for r in range(world)]
    if replicas in ("all", True):
        return [list(range(world))]
    if replicas in (None, False, "none"):
        return [[r] for r in range(world)]
    try:
        if isinstance(replicas, (str, bool)):
            raise TypeError("not a list of rank groups")
        groups = [sorted(operator.index(r) for r in g) for g in replicas]
    except TypeError as e:
        raise ConfigError(f"replicas={replicas!r}: expected 'auto', 'all', 'none' or a list of "
                          f"rank groups such as [[0, 1], [2, 3]] ({e})") from None
    if sorted(r for g in groups for r in g) != list(range(world)):
        raise ConfigError(f"replica groups {groups} must partition ranks 0..{world - 1}")
    return groups


class Coordinator:
    """Agreed flushes and restores for one rank (see the package docstring)."""

    def __init__(self, local: LocalSnapshots, settings: Settings, replicas: Replicas = "auto",
                 heartbeat_s: float = 0.5, peer_timeout_s: float | None = None,
                 commit_timeout_s: float | None = None, restore_timeout_s: float = 300.0,
                 node_replica: bool | str | None = None, fresh: bool | None = None) -> None:
        """``settings``: the environment, read by the caller (the Snapshotter) when it
        started; ``node_replica``: node-loss replication, True or "xor:K" (.replica, .parity;
        default CUDASNAP_NODE_REPLICA); ``fresh``: the Snapshotter starts over (its node's
        guest copies of this job are removed; default CUDASNAP_FRESH)."""
        import dataclasses

        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("distributed snapshots need torch.distributed initialised")
        cfg = settings
        if node_replica is not None or fresh is not None:  # keyword arguments win
            mode = node_replica_mode(node_replica) if node_replica is not None else None
            cfg = dataclasses.replace(
                cfg, node_replica=cfg.node_replica if mode is None else mode >= 1,
                node_parity=cfg.node_parity if mode is None else mode if mode >= 2 else 0,
                fresh=cfg.fresh if fresh is None else fresh)
        self.local = local
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if local.rank != self.rank or local.world_size != self.world:
            raise ConfigError(f"Snapshotter rank/world {local.rank}/{local.world_size} differ "
                              f"from torch.distributed's {self.rank}/{self.world}")
        self.replica_groups = replica_groups(replicas, self.world,
                                             replicas == "auto" and local.replicated())
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s or cfg.peer_timeout_s
        # Every wait of a flush round ends within this (torchrun: SIGKILL 30 s after SIGTERM).
        self.flush_timeout_s = commit_timeout_s or cfg.flush_timeout_s
        self.epoch = cfg.restart  # TORCHELASTIC_RESTART_COUNT wins (cudasnap.config)
        warn_if_restarts_share_the_store(self.rank)
        inst = _instance(local.job, self.epoch)
        self.kv = KV(f"cudasnap/{local.job}/e{self.epoch}/{inst}")
        self.replica: Replicator | None = None
        if cfg.node_replica and store_is_per_round():
            # torchrun counts restarts per agent: a replacement node starts at 0 while the
            # survivors count on. The first rank's count wins (the store is new per round;
            # torchrun's shared store is not, and there every agent's count is the same).
            self.kv.prefix = f"cudasnap/{local.job}/"
            self.epoch = int(self.kv.propose("epoch", str(self.epoch)))
            self.kv.prefix = f"cudasnap/{local.job}/e{self.epoch}/{inst}"
        self.events = EventLog(local.directory, self.rank, self.epoch)
        from .replica import default_addr

        self.live = Liveness(self.kv, self.rank, self.world, self.peer_timeout_s,
                             self.complete_steps, local.last_step, heartbeat_s=heartbeat_s,
                             addr=cfg.replica_addr or default_addr(), node=cfg.node)
        copies = None
        if cfg.node_replica:
            from .held_copies import HeldCopies
            from .replica import Replicator

            self.replica = Replicator(self.kv, local, cfg)
            copies = HeldCopies(self.replica, self.kv, self.rank)
        self.rounds = FlushRounds(self.kv, self.live, local, self.events,
                                  replica_groups=self.replica_groups, epoch=self.epoch,
                                  heartbeat_s=heartbeat_s, flush_timeout_s=self.flush_timeout_s,
                                  copies=copies)
        self.vote = RestoreVote(self.kv, local, self.events, replica_groups=self.replica_groups,
                                timeout_s=restore_timeout_s, replica=self.replica)
        # The first heartbeat before __init__ returns: a rank that freezes (SIGSTOP) soon
        # after, before its monitor thread ever ran, must still be timed out ("a peer that
        # never sent a heartbeat" is one still starting, and is not).
        self.live.beat()
        self._stop = threading.Event()
        self._keeps = True  # whether close() keeps the arena (stop(keeps=...)): the warning
        self._actions: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._joined: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="cudasnap-peers", daemon=True)
        self.kv.monitor_thread = self._thread
        self._worker = threading.Thread(target=self._act, name="cudasnap-peer-actions",
                                        daemon=True)
        self._thread.start()
        self._worker.start()

    # ------------------------------------------------------------ views
    @property
    def dead(self) -> set[int]:
        return self.live.dead

    @property
    def last_flush(self) -> RoundResult | None:
        return self.rounds.last

    @property
    def gen(self) -> int:
        """Flush rounds this rank took part in, this epoch."""
        return self.rounds.gen

    def complete_steps(self) -> list[int]:
        return self.rounds.complete_steps()

    def replicas_of(self, rank: int) -> list[int]:
        return self.rounds.replicas_of(rank)

    def agree_step(self, g: str, deadline: float | None = None) -> tuple[int, set[int]] | None:
        return self.rounds.agree_step(g, deadline)

    def attach_guard(self, guard: Any) -> None:
        """The guard, once made: a peer's failure goes through it (``LocalSnapshots``)."""
        self.local.attach(guard)

    # ------------------------------------------------------------ verbs
    def flush(self, explicit: bool = False, timeout: float | None = None) -> Path | None:
        """The agreed, committed flush; this rank's directory for the step, or None.

        ``explicit``: the program's own flush (e.g. at the end of the job), not a
        trigger's: the round waits, bounded, for every live rank's newest boundary.
        ``timeout``: the bound of the commit's wait on other writers of ``latest`` (as a
        single rank's ``Storage.write_slot``: past it ``latest`` stays, the step is
        committed); every other wait of a round ends within ``flush_timeout_s``."""
        try:
            return self.rounds.flush(explicit=explicit, timeout=timeout)
        except Exception as e:
            why = store_lost(e)
            if why is None:
                raise
            raise FlushError(f"rank {self.rank}: no flush round: {why}") from e

    def restore(self) -> int:
        """Agreed restore; returns the step to resume at (0 when nothing loadable)."""
        try:
            start = self.vote.restore()
        finally:
            self.live.verify()  # every rank published its presence port before it voted
        if start > 0:
            self._drop_newer(start - 1)
        if self.replica is not None:  # parity of the timeline before the restore
            from .parity import drop_parity_newer

            drop_parity_newer(self.replica.shm, self.local.job, start - 1)
        return start

    def _drop_newer(self, step: int) -> None:
        """The vote may restore a step older than some rank's arena holds: slots newer than
        ``step`` (this rank's arenas; with replication, every copy on this node but its
        ranks' own arenas) are of the timeline before the restore. Emptied, so that a round
        never takes one for the resumed run's step of the same number (a flush picks the
        first slot of its step; on a GPU the re-run need not give the same bytes)."""
        n = sum(empty_newer(arena, step) for arena in self.local.arenas())
        if self.replica is not None:
            from .replica_store import drop_newer

            mine = {self.local.arena_path_of(r) for r in range(self.world)
                    if self.live.host_of(r) == self.live.host}
            n += drop_newer(self.replica.shm, self.local.job, step, mine)
        if n:
            log.warning("rank %d: emptied %d slot(s) newer than the restored step %d (the "
                        "timeline before the restore)", self.rank, n, step)

    @property
    def lost(self) -> str | None:
        """What the last restore saw in memory and could not assemble (None: nothing)."""
        return self.vote.lost

    def stop(self, keeps: bool = True) -> bool:
        """Stops the threads (``close()``). A clean close (not while an exception
        propagates) with this rank's final snapshot committed ends its heartbeat with
        the closed marker: its peers do not take its end for a failure.

        Returns True when this rank's newest snapshot is committed (or it holds none), so
        its arena may go; False while the arena may hold the only copy of the job's
        newest state (a close during an exception, or a step not committed). ``keeps``:
        whether the caller keeps its arena then (``close(keep_arena=False)`` does not: the
        warning says which)."""
        self._keeps = keeps
        self._stop.set()
        self._actions.put(("stop", None))
        for t in (self._thread, self._worker):
            if t is not threading.current_thread():
                t.join(timeout=5)
        try:
            return self._stop_rounds()
        finally:
            self.live.stop()  # its presence port closes: peers see this process gone

    def _stop_rounds(self) -> bool:
        exc = exception_active()  # close() from __exit__, an except or a finally block
        if exc is not None:
            log.warning("rank %d closes during %s: its peers take its end for a failure; "
                        "%s", self.rank, type(exc).__name__, self._arena_fate())
            if self.replica is not None:
                self.replica.stop()
            return False
        try:
            step = self.rounds.final_step()
            if self.replica is not None:  # the guests go once the final step is on disk
                self.replica.stop(clean=step is not None)
            if step is not None:
                self.live.close(step)
                self.events("closed", step=step)
                return True
            log.warning("rank %d closes with its newest step %s not committed: %s; peers "
                        "still running take its end for a failure (flush() on every rank "
                        "before close() ends a multi-rank job)", self.rank,
                        max(self.complete_steps(), default=None), self._arena_fate())
        except Exception as e:  # noqa: BLE001 - the store may be gone when the job dies
            log.warning("rank %d: could not publish its close: %s", self.rank, e)
        return False

    def _arena_fate(self) -> str:
        return ("its snapshots stay in shared memory for the restart" if self._keeps else
                "its snapshots in shared memory are removed (close(keep_arena=False))")

    # ---------------------------------------------------------- threads
    def _run(self) -> None:
        reported: tuple[float, int] | None = None  # the last progress event: (when, step)
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.live.beat()
                reported = self._progress(reported)
                dead = self.live.check()
                if dead:
                    self._actions.put(("dead", dead))
                gen = self.rounds.gen
                if gen not in self._joined and not self.rounds.busy() \
                        and self.kv.get(f"flush/{gen}/request") is not None:
                    self._joined.add(gen)
                    self._actions.put(("join", gen))
            except Exception as e:  # noqa: BLE001 - the store may be gone when the job dies
                if not self._stop.is_set():
                    log.warning("peer monitor: %s", e)

    def _progress(self, reported: tuple[float, int] | None) -> tuple[float, int] | None:
        """Rank 0 and the last rank log the step they reached (events: ``progress``) at
        their first boundary, then every PROGRESS_EVERY_S."""
        step = self.local.last_step()
        if step is None or self.rank not in (0, self.world - 1):
            return reported
        now = time.monotonic()
        if reported is None or (step != reported[1] and now - reported[0] >= PROGRESS_EVERY_S):
            self.events("progress", step=step)
            return now, step
        return reported

    def _act(self) -> None:
        """Runs what the monitor asks for, so that heartbeats go on during a flush."""
        while True:
            kind, arg = self._actions.get()
            if kind == "stop":
                return
            try:
                if kind == "join":
                    if self.rounds.gen == arg and not self.rounds.busy():
                        req = self.kv.get(f"flush/{arg}/request")
                        log.warning("rank %d joins the flush requested by rank %s", self.rank, req)
                        self.local.request_flush()
                elif kind == "dead":
                    self.local.peer_failure(f"rank(s) {arg} dead or silent for more than "
                                            f"{self.peer_timeout_s:.1f} s")
            except Exception as e:  # noqa: BLE001
                if not self._stop.is_set():
                    log.warning("peer action %s: %s", kind, e)
