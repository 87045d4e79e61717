"""Multi-rank jobs on torch.distributed: agreed flush step, global commit, replica restore.

torch.distributed (the c10d store of the default process group) and torchrun's
elastic restart are the engine; cudasnap adds no launcher or rendezvous.

Per rank, every ``heartbeat_s`` a monitor thread publishes
``hb/<rank> = seq:last_step:complete_steps`` in the store (a clone of the
default store: its own connection) and reads the others'. A peer whose
heartbeat stops for ``peer_timeout_s`` (a dead process, or a SIGSTOPped or
otherwise frozen one) triggers ``peer_failure`` on the survivors.

Flush (any trigger on any rank):
  1. agree: the newest step COMPLETE on every rank, from the heartbeats (each
     rank keeps two slots, so the previous step is always still there); the
     first proposal stored under ``flush/step`` (compare_set) wins;
  2. each rank writes ``DIR/step-N/rank-RRRRR/``; the lowest live rank on a
     host also flushes the shared-memory arena of a dead rank on that host;
  3. each rank sets ``flush/done/<rank>``; the lowest live rank waits for all
     of them, then writes ``DIR/step-N/COMMIT`` (JSON, fsync'd) and ``latest``.
     A rank that dies during the flush leaves no marker: the step is not
     committed and restore uses the previous committed step.

Restore: ranks agree (through the store) on the newest step that every rank
can load — from its own shared-memory slot, its own files, or (replicated
state, e.g. DDP) a replica's files of the same step. Sharded state with a
missing shard is an error naming the rank and step, never a partial restore.
Keys are namespaced by job and by ``TORCHELASTIC_RESTART_COUNT``.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import store
from ._native import native
from .errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot, SnapshotError

if TYPE_CHECKING:
    from .snapshotter import Snapshotter

log = logging.getLogger("cudasnap.distributed")
COMMIT = "COMMIT"


def rank_dirname(rank: int) -> str:
    return f"rank-{rank:05d}"


def committed_steps(directory: Path) -> list[store.StoredSnapshot]:
    """Step directories holding a COMMIT marker, newest first."""
    return [s for s in store.list_snapshots(directory) if (s.path / COMMIT).is_file()]


def read_commit(step_dir: Path) -> dict[str, Any]:
    try:
        c = json.loads((step_dir / COMMIT).read_text())
    except (OSError, ValueError) as e:
        raise CorruptSnapshot(f"{step_dir / COMMIT}: unreadable commit marker: {e}") from e
    if not isinstance(c, dict) or not isinstance(c.get("step"), int) \
            or not isinstance(c.get("world_size"), int):
        raise CorruptSnapshot(f"{step_dir / COMMIT}: malformed commit marker")
    return c


class Coordinator:
    """The distributed side of one rank's Snapshotter."""

    def __init__(self, snap: "Snapshotter", replicas: Any = "auto", heartbeat_s: float = 0.5,
                 peer_timeout_s: float | None = None, commit_timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("distributed snapshots need torch.distributed initialised")
        self.snap = snap
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if snap.rank != self.rank or snap.world_size != self.world:
            raise ConfigError(f"Snapshotter rank/world {snap.rank}/{snap.world_size} differ from "
                              f"torch.distributed's {self.rank}/{self.world}")
        self.replica_groups = self._replica_groups(replicas)
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s or float(
            os.environ.get("CUDASNAP_PEER_TIMEOUT_S", "10"))
        self.commit_timeout_s = commit_timeout_s
        self.epoch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                        os.environ.get("CUDASNAP_RESTART", "0")))
        base = dist.distributed_c10d._get_default_store()
        self.store = base.clone()
        self.store.set_timeout(__import__("datetime").timedelta(seconds=30))
        self.prefix = f"cudasnap/{snap.job}/e{self.epoch}/"
        self.host = socket.gethostname()
        self._seq = 0
        self._seen: dict[int, tuple[str, float]] = {}
        self._peers: dict[int, list[int]] = {}
        self.dead: set[int] = set()
        self._stop = threading.Event()
        self._flush_lock = threading.RLock()
        self._gen = 0  # flushes this rank completed in this epoch (keys: flush/<gen>/...)
        self._peer_lock = threading.Lock()
        self.last_flush: dict[str, Any] | None = None
        self._k(f"host/{self.rank}", self.host)
        self._thread = threading.Thread(target=self._run, name="cudasnap-peers", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- helpers
    def _k(self, key: str, value: str | None = None) -> str | None:
        if value is not None:
            self.store.set(self.prefix + key, value)
            return value
        if not self.store.check([self.prefix + key]):
            return None
        return self.store.get(self.prefix + key).decode()

    def _replica_groups(self, replicas: Any) -> list[list[int]]:
        if replicas == "auto":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = any(isinstance(m, DDP) for m in self.snap.state.models.values())
            return [list(range(self.world))] if ddp else [[r] for r in range(self.world)]
        if replicas in ("all", True):
            return [list(range(self.world))]
        if replicas in (None, False, "none"):
            return [[r] for r in range(self.world)]
        groups = [sorted(int(r) for r in g) for g in replicas]
        if sorted(r for g in groups for r in g) != list(range(self.world)):
            raise ConfigError(f"replica groups {groups} must partition ranks 0..{self.world - 1}")
        return groups

    def replicas_of(self, rank: int) -> list[int]:
        return next(g for g in self.replica_groups if rank in g)

    def complete_steps(self) -> list[int]:
        out = []
        for a in (self.snap._arena, self.snap._inherited):
            if a is None:
                continue
            for i in range(a.num_slots):
                info = a.slot_info(i)
                if info["valid"]:
                    out.append(int(info["step"]))
        return sorted(set(out), reverse=True)

    # ------------------------------------------------------ monitoring
    def _beat(self) -> None:
        self._seq += 1
        steps = ",".join(str(s) for s in self.complete_steps())
        last = self.snap.last_step if self.snap.last_step is not None else -1
        self._k(f"hb/{self.rank}", f"{self._seq}:{last}:{steps}")

    def _check_peers(self) -> list[int]:
        with self._peer_lock:
            return self._check_peers_locked()

    def _check_peers_locked(self) -> list[int]:
        now = time.monotonic()
        newly_dead = []
        keys = [self.prefix + f"hb/{r}" for r in range(self.world) if r != self.rank]
        for r, key in zip([r for r in range(self.world) if r != self.rank], keys):
            val = self.store.get(key).decode() if self.store.check([key]) else None
            if val is None:
                seen = self._seen.setdefault(r, ("", now))
            else:
                prev = self._seen.get(r)
                if prev is None or prev[0] != val:
                    self._seen[r] = (val, now)
                    parts = val.split(":")
                    self._peers[r] = [int(s) for s in parts[2].split(",") if s] if len(parts) > 2 \
                        else []
                seen = self._seen[r]
            if r not in self.dead and now - seen[1] > self.peer_timeout_s:
                self.dead.add(r)
                newly_dead.append(r)
        return newly_dead

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
                dead = self._check_peers()
                req = self._k(f"flush/{self._gen}/request")
                if req is not None and not self._flush_lock_busy():
                    log.warning("rank %d joins the flush requested by rank %s", self.rank, req)
                    self.snap.flush(wait=False)
                if dead:
                    detail = f"rank(s) {dead} silent for more than {self.peer_timeout_s:.1f} s"
                    log.error("peer failure: %s", detail)
                    if self.snap.guard is not None:
                        self.snap.guard.trigger("peer_failure", detail)
                    else:
                        self.snap.flush(wait=False)
            except Exception as e:  # noqa: BLE001 - the store may be gone when the job dies
                if not self._stop.is_set():
                    log.warning("peer monitor: %s", e)

    # ----------------------------------------------------------- flush
    def agree_step(self, g: str) -> int | None:
        """The newest step COMPLETE on every rank; the first proposal stored wins.

        Live ranks publish what they hold now (``<g>/have/<rank>``); a dead or
        silent rank counts with what its last heartbeat said (its arena still
        holds those slots). Each rank keeps two slots, so the previous step is
        still there when the newest one was being written at the failure.
        """
        mine = self.complete_steps()
        self._k(f"{g}/have/{self.rank}", ",".join(str(x) for x in mine))
        sets: dict[int, set[int]] = {self.rank: set(mine)}
        end = time.monotonic() + min(5.0, self.peer_timeout_s)
        while True:
            won = self._k(f"{g}/step")
            if won:
                return int(won)
            for r in range(self.world):
                if r not in sets and r not in self.dead:
                    v = self._k(f"{g}/have/{r}")
                    if v is not None:
                        sets[r] = {int(x) for x in v.split(",") if x}
            if all(r in sets or r in self.dead for r in range(self.world)) \
                    or time.monotonic() > end:
                break
            time.sleep(0.02)
        with self._peer_lock:
            for r in range(self.world):
                sets.setdefault(r, set(self._peers.get(r, [])))
        common = set.intersection(*sets.values())
        if not common:
            log.error("no step is COMPLETE on every rank: %s",
                      {r: sorted(v) for r, v in sets.items()})
            return None
        won = self.store.compare_set(self.prefix + f"{g}/step", "", str(max(common))).decode()
        return int(won) if won else max(common)

    def flush(self) -> Path | None:
        """The agreed, committed flush; returns this rank's directory for the step."""
        with self._flush_lock:
            self._check_peers()
            g = f"flush/{self._gen}"
            self.store.compare_set(self.prefix + f"{g}/request", "", str(self.rank))
            step = self.agree_step(g)
            if step is None:
                self._gen += 1
                return None
            t0 = time.perf_counter()
            path = self._flush_rank(self.rank, step, self.snap._arena or self.snap._inherited)
            self._help_dead(step, g)
            self._k(f"{g}/done/{self.rank}", "ok" if path else "missing")
            committer = min(r for r in range(self.world) if r not in self.dead)
            if committer == self.rank:
                self._commit(step, g)
            else:
                self._wait_key(f"{g}/committed", self.commit_timeout_s)
            self._gen += 1
            self.last_flush = {"step": step, "path": path, "seconds": time.perf_counter() - t0}
            return path

    def _flush_lock_busy(self) -> bool:
        if self._flush_lock.acquire(blocking=False):
            self._flush_lock.release()
            return False
        return True

    def _flush_rank(self, rank: int, step: int, arena: Any) -> Path | None:
        if arena is None:
            return None
        slot = next((i for i in range(arena.num_slots) if arena.slot_info(i)["valid"]
                     and arena.slot_info(i)["step"] == step), -1)
        if slot < 0:
            log.error("rank %d: step %d is not in shared memory (%s)", rank, step, arena.path)
            return None
        arena.lease(slot)
        try:
            path, _ = store.write_slot(arena, slot, self.snap.directory,
                                       threads=self.snap.flush_threads, subdir=rank_dirname(rank),
                                       update_latest=False,
                                       extra_manifest={"replica_group": self.replicas_of(rank)})
        finally:
            arena.release(slot)
        return path

    def _help_dead(self, step: int, g: str) -> None:
        """Flush the arenas that dead ranks left on this host (lowest live local rank only)."""
        dead_here = [r for r in sorted(self.dead) if self._k(f"host/{r}") == self.host]
        if not dead_here:
            return
        local_live = [r for r in range(self.world) if r not in self.dead
                      and self._k(f"host/{r}") == self.host]
        if not local_live or min(local_live) != self.rank:
            return
        shm = self.snap.arena_path.parent
        for r in dead_here:
            path = shm / f"cudasnap-{self.snap.job}-r{r}.arena"
            if not path.exists():
                continue
            try:
                arena = native().Arena.open(str(path), True)
                got = self._flush_rank(r, step, arena)
                self._k(f"{g}/done/{r}", "ok" if got else "missing")
                log.warning("rank %d flushed dead rank %d's arena for step %d", self.rank, r, step)
            except SnapshotError as e:
                log.error("cannot flush dead rank %d's arena %s: %s", r, path, e)

    def _wait_key(self, key: str, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = self._k(key)
            if v is not None:
                return v
            time.sleep(0.05)
        return None

    def _commit(self, step: int, g: str) -> None:
        end = time.monotonic() + self.commit_timeout_s
        status: dict[int, str] = {}
        while time.monotonic() < end and len(status) < self.world:
            for r in range(self.world):
                if r not in status:
                    v = self._k(f"{g}/done/{r}")
                    if v is not None:
                        status[r] = v
            if len(status) < self.world:
                time.sleep(0.05)
        step_dir = self.snap.directory / store.step_dirname(step)
        present = [r for r in range(self.world)
                   if (step_dir / rank_dirname(r) / store.MANIFEST).is_file()]
        missing = [r for r in range(self.world) if r not in present]
        uncovered = [r for r in missing if not any(q in present for q in self.replicas_of(r))]
        if uncovered:
            log.error("step %d NOT committed: no durable files for rank(s) %s and no replica",
                      step, uncovered)
            self._k(f"{g}/committed", "failed")
            return
        commit = {"step": step, "world_size": self.world, "present": present, "missing": missing,
                  "replica_groups": self.replica_groups, "time": time.time(), "job": self.snap.job}
        tmp = step_dir / f".{COMMIT}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(commit).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, step_dir / COMMIT)
        native().fsync_dir(str(step_dir))
        store._replace_latest(self.snap.directory, step_dir.name)
        store.prune(self.snap.directory, self.snap.keep)
        self._k(f"{g}/committed", str(step))
        log.warning("step %d committed by rank %d (%d/%d ranks present)", step, self.rank,
                    len(present), self.world)

    # --------------------------------------------------------- restore
    def restore(self) -> int:
        """Agreed restore; returns the step to resume at (0 when nothing loadable)."""
        committed = {s.step: s for s in committed_steps(self.snap.directory)}
        mine = set(self.complete_steps())
        self._k(f"restore/{self.rank}", ",".join(str(s) for s in sorted(mine)))
        peers: list[set[int]] = []
        for r in range(self.world):
            v = self._wait_key(f"restore/{r}", self.commit_timeout_s)
            peers.append({int(x) for x in v.split(",") if x} if v else set())
        shm_common = set.intersection(*peers) if peers else set()
        candidates = sorted(set(committed) | shm_common, reverse=True)
        error: SnapshotError | None = None
        for step in candidates:
            try:
                got = self._restore_step(step, step in mine, committed.get(step))
            except CorruptSnapshot as e:
                log.warning("rank %d: step %d not loadable here: %s", self.rank, step, e)
                got = None
            except IncompatibleSnapshot as e:
                log.error("rank %d: step %d: %s", self.rank, step, e)
                error, got = e, None
            ok = "1" if got is not None else "0"
            self._k(f"restored/{step}/{self.rank}", ok)
            votes = [self._wait_key(f"restored/{step}/{r}", self.commit_timeout_s)
                     for r in range(self.world)]
            if all(v == "1" for v in votes):
                return step + 1
            log.warning("step %d is not loadable on every rank (%s); trying an older one", step,
                        votes)
        if error is not None:
            raise error
        return 0

    def _restore_step(self, step: int, in_shm: bool, snap_dir: Any) -> int | None:
        s = self.snap
        if in_shm:
            for a in (s._arena, s._inherited):
                if a is None:
                    continue
                for i in range(a.num_slots):
                    info = a.slot_info(i)
                    if info["valid"] and info["step"] == step:
                        got = s._restore_from_slot(a, i, f"{a.path} slot {i}")
                        s._stats["restore"] = {"source": "shm", "step": got, "where": str(a.path)}
                        return got
        if snap_dir is None:
            return None
        commit = read_commit(snap_dir.path)
        if commit["world_size"] != self.world and len(self.replica_groups) != 1:
            raise IncompatibleSnapshot(
                f"step {step} was saved by {commit['world_size']} ranks, this job has "
                f"{self.world}, and its state is not replicated")
        sources = [self.rank] + [r for r in self.replicas_of(self.rank) if r != self.rank]
        if commit["world_size"] != self.world:
            sources = list(range(commit["world_size"]))
        for r in sources:
            d = snap_dir.path / rank_dirname(r)
            if (d / store.MANIFEST).is_file():
                got = s._restore_from_dir(d)
                s._stats["restore"] = {"source": "disk" if r == self.rank else f"replica:{r}",
                                       "step": got, "where": str(d)}
                return got
        raise IncompatibleSnapshot(f"rank {self.rank}: step {step} has no files for this rank and "
                                   f"no replica holds them (state not replicated)")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
