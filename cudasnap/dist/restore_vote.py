"""Agreed restore: every rank loads the same step, or none does.

Ranks agree (through the store) on the newest step that every rank can load,
from its own shared-memory slot, its own files, or (replicated state, e.g.
DDP) a replica's files of the same step. Sharded state with a missing shard
is an error naming the rank and step (raised on every rank), never a partial
restore. The shared filesystem must show every rank the same ``DIR``.
"""
from __future__ import annotations

import logging

from ..format.manifest import parse_slot_meta
from ..format.paths import MANIFEST, rank_dirname
from ..storage.posix import StoredSnapshot, committed_steps, read_commit
from ..errors import CorruptSnapshot, IncompatibleSnapshot, SnapshotError
from .events import EventLog
from .flush_round import complete_steps
from .kv import KV, csv, parse_csv
from .local import LocalSnapshots

log = logging.getLogger("cudasnap.dist")


class RestoreVote:
    def __init__(self, kv: KV, local: LocalSnapshots, events: EventLog, *,
                 replica_groups: list[list[int]], timeout_s: float) -> None:
        self.kv, self.local, self.events = kv, local, events
        self.rank, self.world = local.rank, local.world_size
        self.replica_groups = replica_groups
        self.timeout_s = timeout_s
        self._n = 0  # restore() calls this epoch (keys: restore/<n>/...)

    def replicas_of(self, rank: int) -> list[int]:
        return next(g for g in self.replica_groups if rank in g)

    def restore(self) -> int:
        """Agreed restore; returns the step to resume at (0 when nothing loadable)."""
        self.events("restore_start")
        n = self._n
        self._n += 1
        committed = {s.step: s for s in committed_steps(self.local.directory)}
        mine = set(complete_steps(self.local.arenas()))
        self.kv.set(f"restore/{n}/{self.rank}", csv(mine))
        peers: list[set[int]] = []
        for r in range(self.world):
            v = self.kv.wait(f"restore/{n}/{r}", self.timeout_s)
            if v is None:
                raise SnapshotError(f"rank {self.rank}: rank {r} did not take part in the restore "
                                    f"within {self.timeout_s:.0f} s")
            peers.append(parse_csv(v))
        shm_common = set.intersection(*peers)
        candidates = sorted(set(committed) | shm_common, reverse=True)
        errors: list[str] = []
        applied = None
        for step in candidates:
            vote = "0"
            try:
                got = self._restore_step(step, step in mine, committed.get(step))
                if got is not None:
                    vote, applied = "1", step
            except CorruptSnapshot as e:
                log.warning("rank %d: step %d not loadable here: %s", self.rank, step, e)
            except IncompatibleSnapshot as e:
                log.error("%s", e)
                vote = f"E:{e}"
            self.kv.set(f"restore/{n}/{step}/{self.rank}", vote)
            votes = [self.kv.wait(f"restore/{n}/{step}/{r}", self.timeout_s)
                     for r in range(self.world)]
            if all(v == "1" for v in votes):
                self.events("restored", step=step, source=self.local.restore_source())
                return step + 1
            errors += [v[2:] for v in votes if v and v.startswith("E:") and v[2:] not in errors]
            log.warning("step %d is not loadable on every rank (%s); trying an older one", step,
                        {r: (v or "?")[:1] for r, v in enumerate(votes)})
        if errors:
            more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
            raise IncompatibleSnapshot(errors[0] + more)
        if applied is not None:
            raise SnapshotError(f"rank {self.rank} loaded step {applied}, but no step is loadable "
                                f"on every rank; the live state is no longer the initial one")
        self.events("restored", step=None, source=None)
        return 0

    def _check_world(self, step: int, saved_world: int, saved_groups: object,
                     where: str) -> None:
        """A new world size needs replicated state: declared now and when it was saved."""
        # (from a COMMIT file: anything but a one-group list means "not replicated")
        saved_replicated = isinstance(saved_groups, list) and len(saved_groups) == 1
        if saved_world != self.world and (len(self.replica_groups) != 1 or not saved_replicated):
            raise IncompatibleSnapshot(
                f"rank {self.rank}: step {step} ({where}) was saved by {saved_world} ranks, this "
                f"job has {self.world}, and its state is not replicated")

    def _restore_step(self, step: int, in_shm: bool,
                      snap_dir: StoredSnapshot | None) -> int | None:
        local = self.local
        if in_shm:
            for a in local.arenas():
                for i in range(a.num_slots):
                    info = a.slot_info(i)
                    if info["valid"] and info["step"] == step:
                        where = f"{a.path} slot {i}"
                        meta = parse_slot_meta(a.read_meta(i), where)
                        if int(meta.get("world_size", self.world)) != self.world:
                            log.warning("rank %d: %s slot %d is from a job of %s ranks; not used",
                                        self.rank, a.path, i, meta.get("world_size"))
                            continue
                        got = local.restore_from_slot(a, i, where)
                        local.record_restore("shm", got, str(a.path))
                        return got
        if snap_dir is None:
            return None
        commit = read_commit(snap_dir.path)
        saved_world = commit["world_size"]
        self._check_world(step, saved_world, commit.get("replica_groups"), str(snap_dir.path))
        if saved_world == self.world:
            sources = [self.rank] + [r for r in self.replicas_of(self.rank) if r != self.rank]
        else:
            sources = list(range(saved_world))
        for r in sources:
            d = snap_dir.path / rank_dirname(r)
            if (d / MANIFEST).is_file():
                got = local.restore_from_dir(d)
                if r != self.rank:
                    log.warning("rank %d restored step %d from replica rank %d's files; its "
                                "host state (RNG, extra objects) is rank %d's", self.rank, step,
                                r, r)
                local.record_restore("disk" if r == self.rank else f"replica:{r}", got, str(d))
                return got
        raise IncompatibleSnapshot(
            f"rank {self.rank}: step {step} has no files for rank {self.rank} "
            f"({snap_dir.path / rank_dirname(self.rank)} is missing) and no replica holds them "
            f"(state not replicated)")
