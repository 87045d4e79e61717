"""Multi-rank jobs on torch.distributed: agreed flush step, global commit, replica restore.

torch.distributed (the c10d store of the default process group) and torchrun's
elastic restart are the engine; cudasnap adds no launcher or rendezvous. The
store must outlive any one rank: torchrun's agent store, or a FileStore
(``init_method="file://..."``, one file per restart attempt; see
tests/dist/ddp_train.py for why with torch 2.14.1 + gloo). A TCPStore hosted
by rank 0's own process dies with rank 0, and with it the coordination.

Liveness. Per rank, every ``heartbeat_s`` a monitor thread publishes
``hb/<rank> = seq:last_step:complete_steps`` in the store (a clone of the
default store: its own connection) and reads the others'. A peer is dead when
its heartbeat stops for ``peer_timeout_s`` (``CUDASNAP_PEER_TIMEOUT_S``; a
SIGSTOPped or otherwise frozen process) or, for a peer in this pid namespace
of this boot, at once when its process is gone or a zombie. A peer that never
sent a heartbeat is not timed out (it may still be starting). Newly dead
peers trigger ``peer_failure`` on the survivors (default policy: flush, exit
79). Flushes requested by the monitor run on a separate action thread, so
heartbeats continue during a flush.

Flush round ``g`` (any trigger on any rank; the others join when they see
``flush/<g>/request``):
  1. agree: each live rank publishes the steps COMPLETE in its arena
     (``have/<rank>``); the ranks that publish nothing before the agreement
     deadline (``peer_timeout_s`` + slack) form the dead set D. A dead rank
     counts with the steps in its arena, read directly by a live rank on its
     host (``left/<rank>``); with no arena left it counts with its last
     heartbeat, or not at all when a live rank replicates its state. The
     newest step COMPLETE everywhere and D are proposed with compare_set;
     the first proposal wins for every rank;
  2. each live rank writes ``DIR/step-N/rank-RRRRR/`` and sets ``done/<rank>``;
     the lowest live rank on a host also flushes the arena of each rank of D
     on that host and sets its ``done`` marker;
  3. the lowest rank not in D waits for the markers (a rank of D with no live
     rank on its host is not waited for), then writes ``DIR/step-N/COMMIT``
     (JSON, fsync'd) and ``latest``. A rank that dies during the round (not in
     D, no marker) makes the round fail: the step is not committed and restore
     uses shared memory or the previous committed step. Every wait of a round
     ends within ``flush_timeout_s`` (``CUDASNAP_FLUSH_TIMEOUT_S``, default
     25 s: inside torchrun's 30 s SIGTERM grace).
A trigger that finds the last round of this epoch finished and no newer step
COMPLETE returns that round's result at once (e.g. torchrun's SIGTERM after a
``peer_failure`` flush): a second round would wait for ranks that have exited.

Restore: ranks agree (through the store) on the newest step that every rank
can load, from its own shared-memory slot, its own files, or (replicated
state, e.g. DDP) a replica's files of the same step. Sharded state with a
missing shard is an error naming the rank and step (raised on every rank),
never a partial restore. The shared filesystem must show every rank the same
``DIR``. Keys are namespaced by job and by ``TORCHELASTIC_RESTART_COUNT``.

Events (flush_start, agreed, written, committed, restore_start, restored) are
appended with wall-clock times to ``DIR/dist-log.jsonl``.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._native import native
from .errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot, SnapshotError
from .format import paths
from .format.paths import COMMIT, EVENT_LOG, rank_dirname
from .storage import posix
from .storage.posix import committed_steps, read_commit

if TYPE_CHECKING:
    from .snapshotter import Snapshotter

log = logging.getLogger("cudasnap.distributed")
ENV_TEST_DIE_IN_FLUSH = "CUDASNAP_TEST_DIE_IN_FLUSH"  # test hook: this rank dies in a flush


def read_events(directory: Path) -> list[dict[str, Any]]:
    """The coordinator events of ``directory`` (see the module docstring)."""
    try:
        lines = (Path(directory) / EVENT_LOG).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} is not a number") from None


def _csv(steps: Any) -> str:
    return ",".join(str(s) for s in sorted(steps))


def _parse_csv(v: str) -> set[int]:
    return {int(x) for x in v.split(",") if x}


def _proc_ident() -> str:
    """Where a pid means the same process: this boot, this pid namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{boot}/{ns}"


def _pid_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[:1]
    return bool(state) and state[0] in ("Z", "X")


class Coordinator:
    """The distributed side of one rank's Snapshotter."""

    def __init__(self, snap: "Snapshotter", replicas: Any = "auto", heartbeat_s: float = 0.5,
                 peer_timeout_s: float | None = None, commit_timeout_s: float | None = None,
                 restore_timeout_s: float = 300.0) -> None:
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
        self.peer_timeout_s = peer_timeout_s or _env_float("CUDASNAP_PEER_TIMEOUT_S", 10.0)
        # Every wait of a flush round ends within this (torchrun: SIGKILL 30 s after SIGTERM).
        self.flush_timeout_s = commit_timeout_s or _env_float("CUDASNAP_FLUSH_TIMEOUT_S", 25.0)
        self.restore_timeout_s = restore_timeout_s
        self.epoch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                        os.environ.get("CUDASNAP_RESTART", "0")))
        self.store = self._open_store()
        self.store.set_timeout(datetime.timedelta(seconds=30))
        self._store_lock = threading.Lock()  # one store client, several threads
        # The peer monitor has a connection of its own, used by no other thread: its
        # heartbeats never queue behind a flush's or a restore's store traffic.
        self._mon_store = self._open_store()
        self._mon_store.set_timeout(datetime.timedelta(seconds=30))
        self.prefix = f"cudasnap/{snap.job}/e{self.epoch}/"
        self.host = socket.gethostname()
        self._ident = _proc_ident()
        self._seq = 0
        self._seen: dict[int, tuple[str, float]] = {}
        self._peers: dict[int, list[int]] = {}
        self._hosts: dict[int, str] = {self.rank: self.host}
        self._procs: dict[int, tuple[str, int]] = {}
        self.dead: set[int] = set()
        self._stop = threading.Event()
        self._flush_lock = threading.RLock()
        self._gen = 0  # flush rounds this rank took part in, this epoch (keys: flush/<gen>/...)
        self._peer_lock = threading.Lock()
        self.last_flush: dict[str, Any] | None = None
        self._restores = 0  # restore() calls this epoch (keys: restore/<n>/...)
        die = os.environ.get(ENV_TEST_DIE_IN_FLUSH, "").partition(":")
        # "RANK[:MIN_STEP]": that rank SIGKILLs itself in a round of step >= MIN_STEP
        self._die_in_flush = int(die[2] or 0) if die[0] == str(self.rank) else None
        self._k(f"host/{self.rank}", self.host)
        self._k(f"proc/{self.rank}", f"{self._ident}:{os.getpid()}")
        # The first heartbeat before __init__ returns: a rank that freezes (SIGSTOP) soon
        # after, before its monitor thread ever ran, must still be timed out ("a peer that
        # never sent a heartbeat" is one still starting, and is not).
        self._beat()
        self._actions: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._joined: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="cudasnap-peers", daemon=True)
        self._worker = threading.Thread(target=self._act, name="cudasnap-peer-actions",
                                        daemon=True)
        self._thread.start()
        self._worker.start()

    @staticmethod
    def _open_store() -> Any:
        """Our own connection for heartbeats and agreement.

        Under torchrun this is the elastic agent's TCPStore (MASTER_ADDR/PORT with
        TORCHELASTIC_USE_AGENT_STORE): it lives in the agent, outlives every
        worker, and a frozen (SIGSTOPped) or dead worker cannot hold it up — unlike
        a FileStore whose lock a stopped process may be holding. Otherwise a
        clone of the default process group's posix.
        """
        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and addr and port:
            try:
                tcp = dist.TCPStore(addr, int(port), is_master=False,
                                    timeout=datetime.timedelta(seconds=30))
                return dist.PrefixStore("cudasnap-coord", tcp)
            except Exception as e:  # noqa: BLE001 - fall back to the process group's store
                log.warning("agent store %s:%s unavailable (%s); using the process group's store",
                            addr, port, e)
        return dist.distributed_c10d._get_default_store().clone()

    # ----------------------------------------------------------- helpers
    def _k(self, key: str, value: str | None = None) -> str | None:
        if threading.current_thread() is getattr(self, "_thread", None):
            return self._kv(self._mon_store, key, value)  # the monitor's own client
        with self._store_lock:
            return self._kv(self.store, key, value)

    def _kv(self, st: Any, key: str, value: str | None) -> str | None:
        if value is not None:
            st.set(self.prefix + key, value)
            return value
        if not st.check([self.prefix + key]):
            return None
        return st.get(self.prefix + key).decode()

    def _propose(self, key: str, value: str) -> str:
        """compare_set: the first value stored under ``key`` wins; returns the winner."""
        with self._store_lock:
            return self.store.compare_set(self.prefix + key, "", value).decode() or value

    def _event(self, event: str, **kw: Any) -> None:
        rec = {"t": time.time(), "rank": self.rank, "epoch": self.epoch, "event": event,
               "thread": threading.current_thread().name, **kw}
        try:
            fd = os.open(self.snap.directory / EVENT_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o600)
            try:
                os.write(fd, (json.dumps(rec) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("event log: %s", e)

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

    def host_of(self, rank: int) -> str | None:
        h = self._hosts.get(rank)
        if h is None:
            h = self._k(f"host/{rank}")
            if h is not None:
                self._hosts[rank] = h
        return h

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

    def _arena_of(self, rank: int) -> Path:
        return paths.arena_path(self.snap.arena_path.parent, self.snap.job, rank)

    def _arena_steps(self, rank: int) -> set[int] | None:
        """Steps COMPLETE in another rank's arena on this host; None when it has none."""
        path = self._arena_of(rank)
        if not path.exists():
            return None
        try:
            arena = native().Arena.open(str(path), False)
            return {int(arena.slot_info(i)["step"]) for i in range(arena.num_slots)
                    if arena.slot_info(i)["valid"]}
        except SnapshotError as e:
            log.warning("cannot read dead rank %d's arena %s: %s", rank, path, e)
            return None

    # ------------------------------------------------------ monitoring
    def _beat(self) -> None:
        self._seq += 1
        steps = ",".join(str(s) for s in self.complete_steps())
        last = self.snap.last_step if self.snap.last_step is not None else -1
        self._k(f"hb/{self.rank}", f"{self._seq}:{last}:{steps}")

    def _check_peers(self) -> list[int]:
        with self._peer_lock:
            return self._check_peers_locked()

    def _proc_dead(self, r: int) -> bool:
        proc = self._procs.get(r)
        if proc is None:
            v = self._k(f"proc/{r}")
            if v is None:
                return False
            ident, _, pid = v.rpartition(":")
            proc = self._procs[r] = (ident, int(pid))
        return proc[0] == self._ident and _pid_gone(proc[1])

    def _check_peers_locked(self) -> list[int]:
        now = time.monotonic()
        newly_dead = []
        for r in range(self.world):
            if r == self.rank or r in self.dead:
                continue
            val = self._k(f"hb/{r}")
            if val is not None:
                prev = self._seen.get(r)
                if prev is None or prev[0] != val:
                    self._seen[r] = (val, now)
                    parts = val.split(":")
                    self._peers[r] = [int(s) for s in parts[2].split(",") if s] \
                        if len(parts) > 2 else []
            seen = self._seen.get(r)
            silent = seen is not None and now - seen[1] > self.peer_timeout_s
            if silent or self._proc_dead(r):
                self.dead.add(r)
                newly_dead.append(r)
                log.error("rank %d: peer rank %d is %s", self.rank, r,
                          f"silent for more than {self.peer_timeout_s:.1f} s" if silent
                          else "gone (its process exited)")
        return newly_dead

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
                dead = self._check_peers()
                if dead:
                    self._actions.put(("dead", dead))
                gen = self._gen
                if gen not in self._joined and not self._flush_lock_busy() \
                        and self._k(f"flush/{gen}/request") is not None:
                    self._joined.add(gen)
                    self._actions.put(("join", gen))
            except Exception as e:  # noqa: BLE001 - the store may be gone when the job dies
                if not self._stop.is_set():
                    log.warning("peer monitor: %s", e)

    def _act(self) -> None:
        """Runs what the monitor asks for, so that heartbeats go on during a flush."""
        while True:
            kind, arg = self._actions.get()
            if kind == "stop":
                return
            try:
                if kind == "join":
                    if self._gen == arg and not self._flush_lock_busy():
                        req = self._k(f"flush/{arg}/request")
                        log.warning("rank %d joins the flush requested by rank %s", self.rank, req)
                        self.snap.flush(wait=False)
                elif kind == "dead":
                    detail = f"rank(s) {arg} dead or silent for more than " \
                             f"{self.peer_timeout_s:.1f} s"
                    if self.snap.guard is not None:
                        self.snap.guard.trigger("peer_failure", detail)
                    else:
                        self.snap.flush(wait=False)
            except Exception as e:  # noqa: BLE001
                if not self._stop.is_set():
                    log.warning("peer action %s: %s", kind, e)

    # ----------------------------------------------------------- flush
    def agree_step(self, g: str, deadline: float | None = None) -> tuple[int, set[int]] | None:
        """(step, dead set D) of round ``g``; the first proposal stored wins.

        Live ranks publish what they hold now (``<g>/have/<rank>``); the ranks
        that publish nothing before the agreement deadline form D. A rank of D
        counts with the steps in its arena (read by a live rank on its host),
        else with its last heartbeat, or not at all when a live replica holds
        its state. Each rank keeps two slots, so the previous step is still
        there when the newest one was being written at the failure.
        """
        mine = self.complete_steps()
        self._k(f"{g}/have/{self.rank}", _csv(mine))
        sets: dict[int, set[int]] = {self.rank: set(mine)}
        left: dict[int, set[int] | None] = {}
        end = time.monotonic() + self.peer_timeout_s + 4 * self.heartbeat_s
        if deadline is not None:
            end = min(end, deadline)
        checked = 0.0
        while True:
            won = self._k(f"{g}/step")
            if won is not None:
                return self._parse_agreed(won)
            if time.monotonic() - checked > 0.1:
                self._check_peers()
                checked = time.monotonic()
            for r in range(self.world):
                if r in sets:
                    continue
                v = self._k(f"{g}/have/{r}")
                if v is not None:
                    sets[r] = _parse_csv(v)
                elif r in self.dead and r not in left and self.host_of(r) == self.host:
                    left[r] = self._arena_steps(r)
                    self._k(f"{g}/left/{r}", "?" if left[r] is None else _csv(left[r]))
            waiting = [r for r in range(self.world) if r not in sets and r not in self.dead]
            # A dead rank elsewhere: give a live rank on its host time to read its arena.
            waiting += [r for r in self.dead if r not in sets and r not in left
                        and self._k(f"{g}/left/{r}") is None
                        and self._live_host_mate(r, set()) is not None]
            if not waiting or time.monotonic() > end:
                break
            time.sleep(0.02)
        dead = {r for r in range(self.world) if r not in sets}
        use = dict(sets)
        fallback: dict[int, set[int]] = {}
        for r in sorted(dead):
            got = left.get(r)
            if got is None:
                v = self._k(f"{g}/left/{r}")
                got = _parse_csv(v) if v not in (None, "?") else None
            covered = any(q not in dead for q in self.replicas_of(r) if q != r)
            if got is not None:
                use[r] = got
                if covered:
                    fallback[r] = got
            elif not covered:
                with self._peer_lock:
                    use[r] = set(self._peers.get(r, []))
        common = set.intersection(*use.values())
        if not common and fallback:
            # A dead rank's arena lacks the live ranks' steps, but replicas hold its state.
            common = set.intersection(*[v for r, v in use.items() if r not in fallback])
        if not common:
            log.error("no step is COMPLETE on every rank: %s", {r: sorted(v) for r, v in use.items()})
        proposal = f"{max(common) if common else -1};{_csv(dead)}"
        return self._parse_agreed(self._propose(f"{g}/step", proposal))

    @staticmethod
    def _parse_agreed(v: str) -> tuple[int, set[int]] | None:
        step, _, dead = v.partition(";")
        return None if int(step) < 0 else (int(step), _parse_csv(dead))

    def _live_host_mate(self, rank: int, dead: set[int]) -> int | None:
        """The lowest rank on ``rank``'s host that is neither in ``dead`` nor dead now."""
        host = self.host_of(rank)
        mates = [r for r in range(self.world) if r != rank and r not in dead
                 and r not in self.dead and self.host_of(r) == host]
        return min(mates) if mates else None

    def flush(self) -> Path | None:
        """The agreed, committed flush; returns this rank's directory for the step.

        None when no step could be agreed on or the round did not commit.
        """
        with self._flush_lock:
            g = f"flush/{self._gen}"
            self._check_peers()
            last = self.last_flush
            newest = max(self.complete_steps(), default=None)
            if last is not None and self._k(f"{g}/request") is None and (
                    newest is None or (last["step"] is not None and newest <= last["step"])
                    or last["step"] is None and newest == last.get("newest")):
                log.warning("rank %d: flush round %d of this epoch already ended (step %s, %s); "
                            "nothing newer to flush", self.rank, self._gen - 1, last["step"],
                            "committed" if last["committed"] else "NOT committed")
                return last["path"] if last["committed"] else None
            t0 = time.perf_counter()
            deadline = time.monotonic() + self.flush_timeout_s
            self._propose(f"{g}/request", str(self.rank))
            self._event("flush_start", gen=self._gen, newest=newest)
            agreed = self.agree_step(g, deadline)
            if agreed is None:
                self._event("agree_failed", gen=self._gen)
                self._gen += 1
                self.last_flush = {"step": None, "path": None, "committed": False,
                                   "newest": newest, "seconds": time.perf_counter() - t0}
                return None
            step, dead = agreed
            self._event("agreed", gen=self._gen, step=step, dead=sorted(dead))
            path = None
            # The writer of each rank directory is claimed: this rank, or (when it was too
            # slow to count and looked dead) the helper on its host; never both.
            if self._propose(f"{g}/writer/{self.rank}", str(self.rank)) == str(self.rank):
                path = self._flush_rank(self.rank, step, self.snap._arena or self.snap._inherited)
                if self._die_in_flush is not None and step >= self._die_in_flush:
                    log.error("%s: rank %d dies inside the flush of step %d", ENV_TEST_DIE_IN_FLUSH,
                              self.rank, step)
                    os.kill(os.getpid(), signal.SIGKILL)
                self._k(f"{g}/done/{self.rank}", "ok" if path else "missing")
            else:
                log.warning("rank %d: a helper flushed this rank's arena for step %d", self.rank,
                            step)
                path = self.snap.directory / paths.step_dirname(step) / rank_dirname(self.rank)
            self._help_dead(step, g, dead)
            self._event("written", gen=self._gen, step=step)
            committer = min(r for r in range(self.world) if r not in dead)
            if committer == self.rank:
                ok = self._commit(step, g, dead, deadline)
            else:
                ok = self._wait_committed(g, step, committer, deadline)
            self._gen += 1
            self.last_flush = {"step": step, "path": path, "committed": ok, "newest": newest,
                               "seconds": time.perf_counter() - t0}
            return path if ok else None

    def _flush_lock_busy(self) -> bool:
        if self._flush_lock.acquire(blocking=False):
            self._flush_lock.release()
            return False
        return True

    def _clear_stale(self, step: int, rank: int) -> None:
        """Files of ``rank`` for an uncommitted ``step`` are from a failed round: rewrite them."""
        step_dir = self.snap.directory / paths.step_dirname(step)
        d = step_dir / rank_dirname(rank)
        if d.exists() and not (step_dir / COMMIT).exists():
            log.warning("removing %s: left by a round that did not commit", d)
            shutil.rmtree(d, ignore_errors=True)

    def _flush_rank(self, rank: int, step: int, arena: Any) -> Path | None:
        """Writes ``rank``'s slot of ``step``; None (logged) when it cannot."""
        if arena is None:
            return None
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
            self._clear_stale(step, rank)
            path, _ = posix.write_slot(arena, slot, self.snap.directory,
                                       threads=self.snap.flush_threads, subdir=rank_dirname(rank),
                                       update_latest=False,
                                       extra_manifest={"replica_group": self.replicas_of(rank)})
        except SnapshotError as e:
            log.error("rank %d: writing step %d failed: %s", rank, step, e)
            return None
        finally:
            arena.release(slot)
        return path

    def _help_dead(self, step: int, g: str, dead: set[int]) -> None:
        """Flush the arenas that ranks of D left on this host (lowest live local rank only)."""
        for r in sorted(dead):
            if r == self.rank or self.host_of(r) != self.host \
                    or self._live_host_mate(r, dead) != self.rank \
                    or self._propose(f"{g}/writer/{r}", str(self.rank)) != str(self.rank):
                continue
            path = self._arena_of(r)
            got = None
            try:
                if path.exists():
                    got = self._flush_rank(r, step, native().Arena.open(str(path), True))
                    log.warning("rank %d flushed dead rank %d's arena for step %d", self.rank, r,
                                step)
                else:
                    log.error("dead rank %d left no arena (%s)", r, path)
            except SnapshotError as e:
                log.error("cannot flush dead rank %d's arena %s: %s", r, path, e)
            self._k(f"{g}/done/{r}", "ok" if got else "missing")

    def _wait_committed(self, g: str, step: int, committer: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            v = self._k(f"{g}/committed")
            if v is not None:
                return v == str(step)
            self._check_peers()
            if committer in self.dead:
                log.error("rank %d: committer rank %d died during the flush of step %d; "
                          "not committed", self.rank, committer, step)
                return False
            time.sleep(0.05)
        log.error("rank %d: no commit of step %d within %.0f s", self.rank, step,
                  self.flush_timeout_s)
        return False

    def _commit(self, step: int, g: str, dead: set[int], deadline: float) -> bool:
        status: dict[int, str] = {}
        failed: list[int] = []
        while True:
            for r in range(self.world):
                if r not in status:
                    v = self._k(f"{g}/done/{r}")
                    if v is not None:
                        status[r] = v
            pending = [r for r in range(self.world) if r not in status]
            self._check_peers()
            failed = [r for r in pending if r not in dead and r in self.dead]
            waiting = [r for r in pending if r not in dead or self._live_host_mate(r, dead)
                       is not None]
            if failed or not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        step_dir = self.snap.directory / paths.step_dirname(step)
        if failed or [r for r in pending if r not in dead]:
            lost = failed or [r for r in pending if r not in dead]
            log.error("step %d NOT committed: rank(s) %s %s during the flush", step, lost,
                      "died" if failed else f"did not finish within {self.flush_timeout_s:.0f} s")
            self._k(f"{g}/committed", "failed")
            self._event("commit_failed", gen=self._gen, step=step, ranks=lost)
            return False
        present = [r for r in range(self.world)
                   if (step_dir / rank_dirname(r) / paths.MANIFEST).is_file()]
        missing = [r for r in range(self.world) if r not in present]
        uncovered = [r for r in missing if not any(q in present for q in self.replicas_of(r))]
        if uncovered:
            log.error("step %d NOT committed: no durable files for rank(s) %s and no replica",
                      step, uncovered)
            self._k(f"{g}/committed", "failed")
            self._event("commit_failed", gen=self._gen, step=step, ranks=uncovered)
            return False
        commit = {"step": step, "world_size": self.world, "present": present, "missing": missing,
                  "replica_groups": self.replica_groups, "time": time.time(), "job": self.snap.job,
                  "dead": sorted(dead), "epoch": self.epoch}
        posix.write_commit(step_dir, commit)
        posix.replace_latest(self.snap.directory, step_dir.name)
        posix.prune(self.snap.directory, self.snap.keep)
        self._k(f"{g}/committed", str(step))
        self._event("committed", gen=self._gen, step=step, present=present)
        log.warning("step %d committed by rank %d (%d/%d ranks present)", step, self.rank,
                    len(present), self.world)
        return True

    # --------------------------------------------------------- restore
    def restore(self) -> int:
        """Agreed restore; returns the step to resume at (0 when nothing loadable)."""
        self._event("restore_start")
        n = self._restores
        self._restores += 1
        committed = {s.step: s for s in committed_steps(self.snap.directory)}
        mine = set(self.complete_steps())
        self._k(f"restore/{n}/{self.rank}", _csv(mine))
        peers: list[set[int]] = []
        for r in range(self.world):
            v = self._wait_key(f"restore/{n}/{r}", self.restore_timeout_s)
            if v is None:
                raise SnapshotError(f"rank {self.rank}: rank {r} did not take part in the restore "
                                    f"within {self.restore_timeout_s:.0f} s")
            peers.append(_parse_csv(v))
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
            self._k(f"restore/{n}/{step}/{self.rank}", vote)
            votes = [self._wait_key(f"restore/{n}/{step}/{r}", self.restore_timeout_s)
                     for r in range(self.world)]
            if all(v == "1" for v in votes):
                self._event("restored", step=step,
                            source=(self.snap._stats.get("restore") or {}).get("source"))
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
        self._event("restored", step=None, source=None)
        return 0

    def _wait_key(self, key: str, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while True:
            v = self._k(key)
            if v is not None or time.monotonic() >= end:
                return v
            time.sleep(0.02)

    def _check_world(self, step: int, saved_world: int, saved_groups: Any, where: str) -> None:
        """A new world size needs replicated state: declared now and when it was saved."""
        if saved_world != self.world and (len(self.replica_groups) != 1
                                          or len(saved_groups or [[0], [1]]) != 1):
            raise IncompatibleSnapshot(
                f"rank {self.rank}: step {step} ({where}) was saved by {saved_world} ranks, this "
                f"job has {self.world}, and its state is not replicated")

    def _restore_step(self, step: int, in_shm: bool, snap_dir: Any) -> int | None:
        s = self.snap
        if in_shm:
            for a in (s._arena, s._inherited):
                if a is None:
                    continue
                for i in range(a.num_slots):
                    info = a.slot_info(i)
                    if info["valid"] and info["step"] == step:
                        meta = json.loads(a.read_meta(i))
                        if int(meta.get("world_size", self.world)) != self.world:
                            log.warning("rank %d: %s slot %d is from a job of %s ranks; not used",
                                        self.rank, a.path, i, meta.get("world_size"))
                            continue
                        got = s._restore_from_slot(a, i, f"{a.path} slot {i}")
                        s._stats["restore"] = {"source": "shm", "step": got, "where": str(a.path)}
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
            if (d / paths.MANIFEST).is_file():
                got = s._restore_from_dir(d)
                if r != self.rank:
                    log.warning("rank %d restored step %d from replica rank %d's files; its "
                                "host state (RNG, extra objects) is rank %d's", self.rank, step,
                                r, r)
                s._stats["restore"] = {"source": "disk" if r == self.rank else f"replica:{r}",
                                       "step": got, "where": str(d)}
                return got
        raise IncompatibleSnapshot(
            f"rank {self.rank}: step {step} has no files for rank {self.rank} "
            f"({snap_dir.path / rank_dirname(self.rank)} is missing) and no replica holds them "
            f"(state not replicated)")

    def stop(self) -> None:
        self._stop.set()
        self._actions.put(("stop", None))
        for t in (self._thread, self._worker):
            if t is not threading.current_thread():
                t.join(timeout=5)
