"""Agreed restore: every rank loads the same step, or none does.

Ranks agree (through the store) on the newest step that every rank can load,
from its own shared-memory slot, its own files, or (replicated state, e.g.
DDP) a replica's files of the same step. Sharded state with a missing shard
is an error naming the rank and step (raised on every rank), never a partial
restore. The shared filesystem must show every rank the same ``DIR``.

Every rank must also run the same job (``Snapshotter(job=...)``/``CUDASNAP_JOB``):
the store keys are namespaced by it, so ranks of different jobs never see each
other. Each rank therefore also publishes its job under a job-independent key
(``cudasnap/restore-job/e<epoch>/<directory hash>/<rank>``: ranks that share a
directory but not a job meet there, while a process group that restores job A in one
directory and then job B in another never compares B with a peer's stale A); a rank
that finds a peer of another job
fails at once with a ConfigError naming both, and a rank still waiting for a peer
after :data:`WAIT_WARN_S` says so (which ranks, how long, the likely causes).

With node-loss replication (cudasnap.distributed.replica), each rank also publishes the copies its
node holds of other ranks' snapshots (guest arenas, or arenas of renumbered ranks); a step
is a candidate when every rank can obtain it from its own slot or from some node's copy. A
rank whose node was replaced fetches its copy from the holder; one with no copy in memory
anywhere falls back to disk, and says so.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot, SnapshotError
from ..format.manifest import parse_slot_meta
from ..format.paths import MANIFEST, rank_dirname
from ..storage.listing import StoredSnapshot, committed_steps, read_commit
from .events import EventLog
from .kv import KV, csv, parse_csv
from .local import LocalSnapshots, complete_steps

if TYPE_CHECKING:
    from cudasnap._C import Arena

    from .replica import Replicator

log = logging.getLogger("cudasnap.distributed")

#: a rank waiting this long for its peers' restore entries logs which ones and why
WAIT_WARN_S = 10.0
_POLL_S = 0.02


class RestoreVote:
    def __init__(self, kv: KV, local: LocalSnapshots, events: EventLog, *,
                 replica_groups: list[list[int]], timeout_s: float,
                 replica: Replicator | None = None) -> None:
        self.kv, self.local, self.events = kv, local, events
        self.replica = replica
        self.lost: str | None = None  # set by restore() (see _say_lost)
        self._copies: dict[int, dict[int, list[int]]] = {}  # holder rank -> src -> steps
        self._plans: dict[tuple[int, int], dict[str, Any]] = {}  # (rank, step) -> parity rebuild
        self.rank, self.world = local.rank, local.world_size
        self.replica_groups = replica_groups
        self.timeout_s = timeout_s
        self._n = 0  # restore() calls this epoch (keys: restore/<n>/...)

    def replicas_of(self, rank: int) -> list[int]:
        return next(g for g in self.replica_groups if rank in g)

    # ------------------------------------------------------------ job check
    def _job(self) -> str:
        return str(getattr(self.local, "job", "") or "")

    def _epoch(self) -> str:
        # "cudasnap/<job>/e<N>/" or, a later Snapshotter of the job in these processes,
        # "cudasnap/<job>/e<N>/i<n>/" (coordinator._instance): "e<N>" or "e<N>/i<n>"
        parts = self.kv.prefix.rstrip("/").split("/")
        at = max(i for i, x in enumerate(parts) if x[:1] == "e" and x[1:].isdigit())
        return "/".join(parts[at:])

    def _job_key(self, rank: int) -> str:
        """Outside the job's namespace: ``cudasnap/restore-job/<epoch>/<dir hash>/<rank>``.
        Keyed by the directory, not by a count of restores: the ranks of a job need not
        have run the same number of restores in this process (threads as ranks in tests,
        a restore that failed on one rank), but they share its directory."""
        where = hashlib.sha1(str(self.local.directory).encode()).hexdigest()[:16]
        return f"cudasnap/restore-job/{self._epoch()}/{where}/{rank}"

    def _raw(self, key: str, value: str | None = None) -> str | None:
        """get/set of a key without the job prefix, on the KV's shared client."""
        with self.kv._lock:
            st = self.kv.store
            if value is not None:
                st.set(key, value)
                return value
            if not st.check([key]):
                return None
            return str(st.get(key).decode())

    def _publish_job(self) -> None:
        try:
            self._raw(self._job_key(self.rank), self._job())
        except Exception as e:  # noqa: BLE001 - the check is a diagnosis, never a failure
            log.debug("rank %d: job key not published: %s", self.rank, e)

    def _peer_job(self, rank: int) -> str | None:
        try:
            return self._raw(self._job_key(rank))
        except Exception:  # noqa: BLE001
            return None

    def _gather(self, n: int) -> list[str]:
        """Every rank's restore entry; ConfigError at once for a peer of another job."""
        got: dict[int, str] = {}
        start = time.monotonic()
        warned = False
        job = self._job()
        while True:
            for r in range(self.world):
                if r in got:
                    continue
                v = self.kv.get(f"restore/{n}/{r}")
                if v is not None:
                    got[r] = v
                    continue
                theirs = self._peer_job(r)
                if theirs is not None and theirs != job:
                    raise ConfigError(
                        f"rank {self.rank} runs job {job!r} but rank {r} runs job {theirs!r}: "
                        "every rank of a job must use the same job= (Snapshotter(job=...) or "
                        "CUDASNAP_JOB), or none (it is then derived from the directory)")
            if len(got) == self.world:
                return [got[r] for r in range(self.world)]
            waited = time.monotonic() - start
            if waited >= self.timeout_s:
                missing = [r for r in range(self.world) if r not in got]
                raise SnapshotError(f"rank {self.rank}: rank(s) {missing} did not take part in "
                                    f"the restore within {self.timeout_s:.0f} s (job {job!r})")
            if not warned and waited >= min(WAIT_WARN_S, self.timeout_s / 2):
                warned = True
                missing = [r for r in range(self.world) if r not in got]
                log.warning("rank %d: waiting %.0f s (of %.0f s) for rank(s) %s to join the "
                            "restore of job %r in %s; a rank with another job= or CUDASNAP_JOB, "
                            "another directory, or still starting never joins", self.rank,
                            waited, self.timeout_s, missing, job, self.local.directory)
            time.sleep(_POLL_S)

    def restore(self) -> int:
        """Agreed restore; returns the step to resume at (0 when nothing loadable)."""
        self.events("restore_start")
        n = self._n
        self._n += 1
        committed = {s.step: s for s in committed_steps(self.local.directory)}
        mine = set(complete_steps(self.local.arenas()))
        self._publish_job()
        if self.replica is not None:  # before the entry _gather waits for: then it is there
            held = {str(src): steps for src, steps in self.replica.held().items()}
            self.kv.set(f"restore/{n}/held/{self.rank}", json.dumps(held))
            self.kv.set(f"restore/{n}/xor/{self.rank}", json.dumps(self.replica.parity_held()))
        self.kv.set(f"restore/{n}/{self.rank}", csv(mine))
        peers = [parse_csv(v) for v in self._gather(n)]
        if self.replica is not None:
            peers = self._with_copies(n, peers)
        shm_common = set.intersection(*peers)
        candidates = sorted(set(committed) | shm_common, reverse=True)
        self.lost = None
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
                self._say_lost(peers, step)
                source = self.local.restore_source()
                self.events("restored", step=step, source=source)
                if self.replica is not None and source == "disk":
                    log.warning("rank %d: no node holds a copy of its snapshot in memory "
                                "(its node and its partner's lost, or never replicated): "
                                "restored step %d from disk (%s)", self.rank, step,
                                self.local.directory)
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
        self._say_lost(peers, None)
        self.events("restored", step=None, source=None)
        return 0

    def _say_lost(self, peers: list[set[int]], step: int | None) -> None:
        """Steps some rank holds in memory, newer than the one restored (``step``; None:
        nothing), that cannot be assembled because other ranks have no copy of them and
        they are not committed on disk: logged at ERROR naming the steps and the ranks
        (never a silent step 0, issue 35), at INFO for the usual one step a rank that died
        mid-step lacks; ``lost`` keeps the words for the restorer."""
        held = set().union(*peers)
        newer = sorted(s for s in held if step is None or s > step)
        if not newer:
            return
        top = newer[-1]
        missing = [r for r, p in enumerate(peers) if top not in p]
        holders = [r for r, p in enumerate(peers) if top in p]
        lost = (f"step {top} is in the memory of rank(s) {holders} but rank(s) {missing} "
                "have no copy of it (own arena or a partner node's) and it is not committed "
                "on disk")
        # A rank that died mid-step holds one step less: the promised replay of <= 1 step.
        # Louder when more is lost, or a rank's memory is gone altogether (its node lost).
        if step is not None and top - step <= 1 and all(peers):
            log.info("rank %d: %s; restored step %d", self.rank, lost, step)
            return
        self.lost = lost
        log.error("rank %d: %s; %s", self.rank, lost,
                  f"restored the older step {step} instead ({top - step} step(s) lost)"
                  if step is not None else "no step is loadable on every rank")

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
        if self.replica is not None:
            copied = self._restore_copy(step)
            if copied is not None:
                return copied
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

    # ------------------------------------------------------- node-loss copies
    def _with_copies(self, n: int, peers: list[set[int]]) -> list[set[int]]:
        """Each rank's obtainable steps: its own slots, plus every node's copies of it."""
        self._copies = {}
        for h in range(self.world):
            raw = self.kv.get(f"restore/{n}/held/{h}")
            try:
                got = json.loads(raw) if raw else {}
                self._copies[h] = {int(src): [int(x) for x in steps]
                                   for src, steps in got.items()}
            except (ValueError, TypeError, AttributeError):
                log.warning("rank %d: rank %d's list of held copies is malformed", self.rank, h)
        out = [set(p) for p in peers]
        for held in self._copies.values():
            for src, steps in held.items():
                if 0 <= src < self.world:
                    out[src].update(steps)
        self._plans = self._parity_plans(n, peers)
        for src, step in self._plans:
            if 0 <= src < self.world:
                out[src].add(step)
        return out

    def _parity_plans(self, n: int, peers: list[set[int]]) -> dict[tuple[int, int], dict[str, Any]]:
        """XOR parity (cudasnap.distributed.parity): the (rank, step) images the survivors of a
        parity set can rebuild, from every rank's parity files and the slots it serves."""
        from .parity import plans

        entries: list[tuple[int, dict[str, Any]]] = []
        for h in range(self.world):
            try:
                got = json.loads(self.kv.get(f"restore/{n}/xor/{h}") or "[]")
                entries += [(h, t) for t in got if isinstance(t, dict)]
            except (ValueError, TypeError):
                log.warning("rank %d: rank %d's list of parity files is malformed", self.rank, h)
        if not entries:
            return {}
        serving: dict[int, dict[int, list[int]]] = {}
        for r, own in enumerate(peers):  # own slots: rank r's node holds r's arena
            for s in own:
                serving.setdefault(r, {}).setdefault(s, []).append(r)
        for h, held in self._copies.items():  # renumbered ranks' arenas
            for src, steps in held.items():
                for s in steps:
                    serving.setdefault(src, {}).setdefault(s, []).append(h)
        return plans(entries, serving)

    def _copy_fits(self, arena: Arena, slot: int, where: str) -> bool:
        """A copy is this rank's snapshot of a job of this world size (else logged, skipped)."""
        try:
            meta = parse_slot_meta(arena.read_meta(slot), where)
        except CorruptSnapshot as e:
            log.warning("rank %d: %s skipped: %s", self.rank, where, e)
            return False
        rank, world = meta.get("rank", self.rank), meta.get("world_size", self.world)
        if int(rank) != self.rank or int(world) != self.world:
            log.warning("rank %d: %s holds rank %s of %s ranks; not used", self.rank, where,
                        rank, world)
            return False
        return True

    def _restore_copy(self, step: int) -> int | None:
        """This rank's ``step`` from a copy a node holds: this node's first (no transfer),
        then the holders' in rank order. None when no copy restores."""
        from .replica_store import find_slot

        assert self.replica is not None
        local = self.local
        found = find_slot(self.replica.shm, self.replica.job, self.rank, step,
                          skip=self.replica.own_path)
        if found is not None and self._copy_fits(*found, where=str(found[0].path)):
            a, i = found
            got = local.restore_from_slot(a, i, f"{a.path} slot {i}")
            local.record_restore("peer-memory:local", got, str(a.path))
            return got
        for h in sorted(self._copies):
            if h == self.rank or step not in self._copies[h].get(self.rank, []):
                continue
            t0 = time.perf_counter()
            try:
                a, i, path = self.replica.fetch(h, self.rank, step)
            except (OSError, SnapshotError) as e:
                log.warning("rank %d: fetching its step %d from rank %d failed: %s", self.rank,
                            step, h, e)
                continue
            try:
                secs = time.perf_counter() - t0
                if not self._copy_fits(a, i, where=f"rank {h}'s copy"):
                    continue
                got = local.restore_from_slot(a, i, f"rank {h}'s copy ({path.name})")
                log.warning("rank %d restored step %d from the copy in rank %d's node memory "
                            "(fetched in %.2f s)", self.rank, got, h, secs)
                local.record_restore(f"peer-memory:{h}", got, f"rank {h}")
                return got
            except CorruptSnapshot as e:
                log.warning("rank %d: rank %d's copy of step %d: %s", self.rank, h, step, e)
            finally:
                del a
                path.unlink(missing_ok=True)
        return self._restore_parity(step)

    def _restore_parity(self, step: int) -> int | None:
        """This rank's ``step`` rebuilt from its parity set's survivors; None when there is
        no plan for it or the rebuild fails (logged)."""
        plan = self._plans.get((self.rank, step))
        if plan is None or self.replica is None or self.replica.parity is None:
            return None
        t0 = time.perf_counter()
        try:
            a, i, path = self.replica.parity.rebuild(plan, self.local.flush_threads)
        except (OSError, SnapshotError) as e:
            log.warning("rank %d: rebuilding its step %d from parity set %s failed: %s",
                        self.rank, step, plan["members"], e)
            return None
        try:
            if int(a.slot_info(i)["step"]) != step or \
                    not self._copy_fits(a, i, where="the rebuilt image"):
                log.warning("rank %d: the image rebuilt for step %d does not fit (step %d)",
                            self.rank, step, int(a.slot_info(i)["step"]))
                return None
            got = self.local.restore_from_slot(a, i, f"rebuilt image ({path.name})")
            log.warning("rank %d restored step %d rebuilt from XOR parity of set %s (%.2f s)",
                        self.rank, got, plan["members"], time.perf_counter() - t0)
            self.local.record_restore("peer-parity", got, f"set {plan['members']}")
            return got
        except CorruptSnapshot as e:
            log.warning("rank %d: the rebuilt image of step %d: %s", self.rank, step, e)
            return None
        finally:
            del a
            path.unlink(missing_ok=True)
