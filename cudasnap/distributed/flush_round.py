"""One agreed, committed flush round across the ranks.

Round ``g`` (any trigger on any rank; the others join when they see
``flush/<g>/request``):
  1. agree: each live rank publishes the steps COMPLETE in its arena (``have/<rank>``);
     the ranks that publish nothing before the agreement deadline (``peer_timeout_s`` +
     slack) form the dead set D. A dead rank counts with the steps in its arena, read
     directly by a live rank on its host (``left/<rank>``), or with the steps of the
     copies a live node holds (node-loss replication: ``held/<rank>``,
     cudasnap.distributed.held_copies); with neither it counts with its last heartbeat,
     or not at all when a live rank replicates its state. The newest step COMPLETE
     everywhere and D are proposed with compare_set; the first proposal wins for every rank;
  2. each live rank writes ``DIR/step-N/rank-RRRRR/`` and sets ``done/<rank>``; the lowest
     live rank on a host also flushes the arena of each rank of D on that host, and the
     holder of a copy of a rank of D writes it from the copy
     (cudasnap.distributed.rank_files), each setting its ``done`` marker;
  3. the lowest rank not in D waits for the markers (a rank of D with no live rank on its
     host is not waited for), then writes ``DIR/step-N/COMMIT`` and ``latest``. (An
     object-store URL: the same names under the URL, uploaded; ``latest`` by
     compare-and-swap; Storage.commit: posix, remote_ranks.) A rank that dies during
     the round (not in D, no marker) makes the round fail: the step is not committed, and
     the ranks start round ``g+1`` (``retry``), where it is in D, at most twice more.
     Every wait ends within ``flush_timeout_s`` (``latest``'s lock: and the flush's timeout).
A trigger that finds the last round of this epoch finished and no newer step COMPLETE
returns that round's result at once (e.g. torchrun's SIGTERM after a ``peer_failure``
flush): a second round would wait for ranks that have exited.

Explicit rounds (the end of a job). A ``flush()`` the program calls itself, not a
trigger's, proposes its newest step as the round's target (``flush/<g>/target``): in
step 1 every rank then waits, within the agreement deadline, until each live rank's
COMPLETE steps hold the target (a rank republishes ``have/<rank>`` as its copies
complete), rather than settling on the older step that is COMPLETE everywhere while a
rank's last boundary is still on its way. Dead ranks are never waited for; the round of
a trigger (a signal, a health event, a peer failure) has no target and waits for no
boundary at all.

Closed ranks. A rank that closed with its final snapshot committed (its heartbeat says
``closed:<step>``, see liveness) ended the job; it is not dead. A round already open
does not wait for it (it counts with that step, or not at all when a live replica
covers it); a new round is not opened when it cannot include the closed rank's state:
the flush returns at once, logging that its newer steps cannot be committed.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from .._native import native
from .._points import reach
from ..errors import SnapshotError
from ..format.paths import rank_dirname, step_dirname
from .events import EventLog
from .kv import KV, csv, parse_csv
from .liveness import Liveness
from .local import LocalSnapshots, complete_steps
from .rank_files import RankFiles

if TYPE_CHECKING:
    from ..storage.protocol import Storage
    from .held_copies import HeldCopies

log = logging.getLogger("cudasnap.distributed")


class RoundResult(TypedDict):
    """How this rank's last flush round ended (``FlushRounds.last``)."""

    step: int | None  # the agreed step (None: no step could be agreed on)
    path: Path | None  # this rank's directory of the step (None: not written)
    committed: bool
    newest: int | None  # the newest step COMPLETE here when the round started
    seconds: float


class FlushRounds:
    def __init__(self, kv: KV, live: Liveness, local: LocalSnapshots, events: EventLog, *,
                 replica_groups: list[list[int]], epoch: int, heartbeat_s: float,
                 flush_timeout_s: float, copies: HeldCopies | None = None) -> None:
        """``copies``: the copies of other nodes' ranks this node holds (node-loss
        replication on): a round writes a dead rank's files from them (held_copies)."""
        self.kv, self.live, self.local, self.events = kv, live, local, events
        self.copies = copies
        self.rank, self.world = live.rank, live.world
        self.replica_groups = replica_groups
        self.epoch = epoch
        self.heartbeat_s = heartbeat_s
        self.flush_timeout_s = flush_timeout_s
        self.lock = threading.RLock()
        # Where the parts and the COMMIT go: the Snapshotter's storage (storage.protocol).
        self.store: Storage = local.storage
        self.files = RankFiles(self.store, kv, live, local, copies, self.replicas_of)
        self.gen = 0  # rounds this rank took part in, this epoch (keys: flush/<gen>/...)
        self.last: RoundResult | None = None
        self._latest_wait: float | None = None  # the running flush's timeout (_lock_wait)

    def replicas_of(self, rank: int) -> list[int]:
        return next(g for g in self.replica_groups if rank in g)

    def complete_steps(self) -> list[int]:
        return complete_steps(self.local.arenas())

    def busy(self) -> bool:
        if self.lock.acquire(blocking=False):
            self.lock.release()
            return False
        return True

    # ------------------------------------------------------------ agree
    def _arena_steps(self, rank: int) -> set[int] | None:
        """Steps COMPLETE in another rank's arena on this host; None when it has none."""
        path = self.local.arena_path_of(rank)
        if not path.exists():
            return None
        try:
            return set(complete_steps([native().Arena.open(str(path), False)]))
        except SnapshotError as e:
            log.warning("cannot read dead rank %d's arena %s: %s", rank, path, e)
            return None

    def agree_step(self, g: str, deadline: float | None = None) -> tuple[int, set[int]] | None:
        """(step, dead set D) of round ``g``; the first proposal stored wins.

        Each rank keeps two slots, so the previous step is still there when the
        newest one was being written at the failure. In an explicit round (one with a
        target, see the module docstring) the proposal waits, within the same deadline,
        for every live rank to hold the target step.
        """
        mine = self.complete_steps()
        self.kv.set(f"{g}/have/{self.rank}", csv(mine))
        end = time.monotonic() + self.live.peer_timeout_s + 4 * self.heartbeat_s
        if deadline is not None:
            end = min(end, deadline)
        won, sets, left = self._gather(g, set(mine), end)
        if won is None:  # this rank proposes: the first proposal stored wins
            won = self.kv.propose(f"{g}/step", self._proposal(g, sets, left))
        return self._parse_agreed(won)

    def _gather(self, g: str, mine: set[int], end: float
                ) -> tuple[str | None, dict[int, set[int]], dict[int, set[int] | None]]:
        """Every rank's COMPLETE steps (``have/``), a dead rank's from its arena read by a
        host mate (``left/``) or its copy's holder, until none is awaited or ``end``:
        (the agreed step's record when another rank's proposal won meanwhile, else None;
        steps by rank; steps read from dead ranks' arenas)."""
        live, kv = self.live, self.kv
        sets: dict[int, set[int]] = {self.rank: mine}
        left: dict[int, set[int] | None] = {}
        checked = 0.0
        target: int | None = None
        behind: list[int] = []
        settled: int | None = None
        offered: set[int] = set()
        while True:
            won = kv.get(f"{g}/step")
            if won is not None:
                return won, sets, left
            if time.monotonic() - checked > 0.1:
                live.check()
                checked = time.monotonic()
            if target is not None and target not in sets[self.rank]:
                reached = self.local.last_step()
                if reached is not None and reached >= target and reached != settled:
                    settled = reached  # zero-overhead mode: the boundary was not copied
                    self.local.settle_newest(max(0.0, end - time.monotonic()))
                now_mine = self.complete_steps()  # this rank's last copy may complete now
                if set(now_mine) != sets[self.rank]:
                    sets[self.rank] = set(now_mine)
                    kv.set(f"{g}/have/{self.rank}", csv(now_mine))
            for r in range(self.world):
                if r in sets:
                    if r in behind:  # republished as its copies complete
                        v = kv.get(f"{g}/have/{r}")
                        if v is not None:
                            sets[r] = parse_csv(v)
                    continue
                v = kv.get(f"{g}/have/{r}")
                if v is not None:
                    sets[r] = parse_csv(v)
                elif r in live.dead and r not in left and live.host_of(r) == live.host:
                    left[r] = self._arena_steps(r)
                    kv.set(f"{g}/left/{r}", "?" if left[r] is None else csv(left[r] or ()))
                elif r in live.dead and self.copies is not None and r not in offered:
                    offered.add(r)
                    self.copies.offer(g, r)
            waiting = [r for r in range(self.world) if r not in sets and r not in live.dead
                       and r not in live.closed]
            # A dead rank elsewhere: give a live rank on its host time to read its arena.
            waiting += [r for r in live.dead if r not in sets and r not in left
                        and kv.get(f"{g}/left/{r}") is None
                        and live.live_host_mate(r, set()) is not None]
            if self.copies is not None:  # a dead rank elsewhere: the node of its copy offers it
                waiting += [r for r in live.dead if r not in sets and r not in left
                            and r not in waiting and self.copies.awaited(g, r, live.dead)]
            if not waiting and target is None:
                v = kv.get(f"{g}/target")  # proposed before the requester's have/
                target = int(v) if v is not None else None
            behind = [] if target is None else \
                [r for r, v in sets.items() if target not in v and r not in live.dead
                 and r not in live.closed]
            if not waiting and not behind:
                break
            if time.monotonic() > end:
                if behind and not waiting:
                    log.warning("rank %d: rank(s) %s did not complete step %d (the explicit "
                                "flush's) within %.1f s; agreeing on an older step", self.rank,
                                behind, target, live.peer_timeout_s + 4 * self.heartbeat_s)
                break
            time.sleep(0.02)
        return None, sets, left

    def _proposal(self, g: str, sets: dict[int, set[int]],
                  left: dict[int, set[int] | None]) -> str:
        """This rank's proposal ``"<step>;<dead ranks>"``: the newest step every rank holds
        (a dead rank: its arena as read, its held copy, a replica's files, or what its
        heartbeats said), -1 for none."""
        live, kv = self.live, self.kv
        dead = {r for r in range(self.world) if r not in sets}
        use = dict(sets)
        fallback: dict[int, set[int]] = {}
        closed = dict(live.closed)
        for r in sorted(dead):
            covered = any(q not in dead for q in self.replicas_of(r) if q != r)
            if r in closed:  # ended the job: its files hold its final step, nothing newer
                if not covered:
                    use[r] = {closed[r]} if closed[r] >= 0 else set()
                continue
            got = left.get(r)
            if got is None:
                v = kv.get(f"{g}/left/{r}")
                got = parse_csv(v) if v is not None and v != "?" else None
            held = self.copies.published(g, r) if got is None and self.copies else None
            if held is not None:
                got = held[1]
            if got is not None:
                use[r] = got
                if covered:
                    fallback[r] = got
            elif not covered:
                with live.lock:
                    use[r] = set(live.peer_steps.get(r, []))
        common = set.intersection(*use.values())
        if not common and fallback:
            # A dead rank's arena lacks the live ranks' steps, but replicas hold its state.
            common = set.intersection(*[v for r, v in use.items() if r not in fallback])
        if not common:
            log.error("no step is COMPLETE on every rank: %s", {r: sorted(v) for r, v in use.items()})
        return f"{max(common) if common else -1};{csv(dead)}"

    def final_step(self) -> int | None:
        """This rank's newest COMPLETE step if it is committed with this rank's files (-1:
        no snapshot at all); None while it is not (a close then loses it)."""
        newest = max(self.complete_steps(), default=None)
        if newest is None:
            return -1
        last = self.last
        if last is not None and last["committed"] and last["step"] is not None \
                and newest <= last["step"]:
            return last["step"]
        return newest if self.store.committed_with(newest, self.rank) else None

    @staticmethod
    def _parse_agreed(v: str) -> tuple[int, set[int]] | None:
        step, _, dead = v.partition(";")
        return None if int(step) < 0 else (int(step), parse_csv(dead))

    # ------------------------------------------------------------ round
    def flush(self, explicit: bool = False, timeout: float | None = None) -> Path | None:
        """The agreed, committed flush; returns this rank's directory for the step.

        None when no step could be agreed on or the round did not commit. ``explicit``:
        the program's own ``flush()`` (not a trigger's): a round it opens waits, bounded,
        for every live rank's copy of this rank's newest step (see the module docstring).
        ``timeout``: the commit's wait on other writers of ``latest`` (else the round's)."""
        with self.lock:
            self._latest_wait = timeout
            g = f"flush/{self.gen}"
            self.live.check()
            last = self.last
            newest = max(self.complete_steps(), default=None)
            requested = self.kv.get(f"{g}/request") is not None
            if last is not None and not requested and (
                    newest is None or (last["step"] is not None and newest <= last["step"])
                    or last["step"] is None and newest == last.get("newest")):
                log.warning("rank %d: flush round %d of this epoch already ended (step %s, %s); "
                            "nothing newer to flush", self.rank, self.gen - 1, last["step"],
                            "committed" if last["committed"] else "NOT committed")
                path: Path | None = last["path"] if last["committed"] else None
                return path
            closed = dict(self.live.closed)
            lost = [r for r in closed if not any(q not in closed and q not in self.live.dead
                                                 for q in self.replicas_of(r))]
            if lost and not requested:
                # Ranks that ended the job took their newer state with them: no round.
                done = last is not None and last["committed"]
                log.warning("rank %d: rank(s) %s closed (the end of the job) with step(s) %s "
                            "committed; step %s here cannot be committed without them (the "
                            "newest committed step stays %s)", self.rank, sorted(lost),
                            sorted({closed[r] for r in lost}), newest,
                            last["step"] if done and last is not None else
                            max(closed[r] for r in lost))
                self.events("closed_peers", gen=self.gen, ranks=sorted(lost), newest=newest)
                return last["path"] if done and last is not None else None
            t0 = time.perf_counter()
            written: tuple[int, Path] | None = None
            for tries in range(3):
                deadline = time.monotonic() + self.flush_timeout_s  # this round's waits
                g = f"flush/{self.gen}"
                ok, step, path = self._round(g, explicit and tries == 0, newest, deadline,
                                             written)
                self.gen += 1
                self.last = {"step": step, "path": path, "committed": ok,
                             "newest": newest, "seconds": time.perf_counter() - t0}
                # A rank died in the round: every rank (the committer's key decides) runs
                # the next one, which counts it with D (its arena or copy, by a survivor).
                if ok or self.kv.get(f"{g}/retry") is None:
                    break
                written = (step, path) if step is not None and path is not None else None
                log.warning("rank %d: rank(s) %s died during flush round %s; a new round",
                            self.rank, self.kv.get(f"{g}/retry"), g)
            return path if ok else None

    def _round(self, g: str, explicit: bool, newest: int | None, deadline: float,
               written: tuple[int, Path] | None) -> tuple[bool, int | None, Path | None]:
        """One round ``g``: (committed, the agreed step, this rank's directory of it).
        ``written``: (step, directory) this rank wrote in the failed round before: kept,
        not written again, when the step is the same."""
        opened = self.kv.propose(f"{g}/request", str(self.rank)) == str(self.rank)
        if explicit and opened and newest is not None:
            # Before this rank's have/: a rank that sees it sees the target too.
            self.kv.propose(f"{g}/target", str(newest))
        self.events("flush_start", gen=self.gen, newest=newest,
                    **({"target": newest} if explicit and opened else {}))
        agreed = self.agree_step(g, deadline)
        if agreed is None:
            self.events("agree_failed", gen=self.gen)
            return False, None, None
        step, dead = agreed
        self.events("agreed", gen=self.gen, step=step, dead=sorted(dead))
        # The writer of each rank directory is claimed: this rank, or (when it was too
        # slow to count and looked dead) the helper on its host; never both.
        if self.kv.propose(f"{g}/writer/{self.rank}", str(self.rank)) == str(self.rank):
            arenas = self.local.arenas()
            path = written[1] if written is not None and written[0] == step else \
                self.files.write(self.rank, step, arenas[0] if arenas else None)
            reach("dist.flush_written", rank=self.rank, step=step)
            self.kv.set(f"{g}/done/{self.rank}", "ok" if path else "missing")
        else:
            log.warning("rank %d: a helper flushed this rank's arena for step %d", self.rank,
                        step)
            path = self.local.directory / step_dirname(step) / rank_dirname(self.rank)
        self.files.write_dead(step, g, dead)
        self.events("written", gen=self.gen, step=step)
        committer = min(r for r in range(self.world) if r not in dead)
        if committer == self.rank:
            ok = self._commit(step, g, dead, deadline)
        else:
            ok = self._wait_committed(g, step, committer, deadline)
            if ok:
                self.store.refresh()
        return ok, step, path

    def _wait_committed(self, g: str, step: int, committer: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            v = self.kv.get(f"{g}/committed")
            if v is not None:
                return v == str(step)
            self.live.check()
            if committer in self.live.dead:
                log.error("rank %d: committer rank %d died during the flush of step %d; "
                          "not committed", self.rank, committer, step)
                self.kv.set(f"{g}/retry", str(committer))
                return False
            time.sleep(0.05)
        with contextlib.suppress(Exception):  # the committer may still be on `latest`'s
            if self.store.committed_with(step, self.rank):  # lock: its COMMIT decides
                return True
        log.error("rank %d: no commit of step %d within the flush's bound (%.0f s a round)",
                  self.rank, step, self.flush_timeout_s)
        return False

    def _commit(self, step: int, g: str, dead: set[int], deadline: float) -> bool:
        status: dict[int, str] = {}
        failed: list[int] = []
        live = self.live
        while True:
            for r in range(self.world):
                if r not in status:
                    v = self.kv.get(f"{g}/done/{r}")
                    if v is not None:
                        status[r] = v
            pending = [r for r in range(self.world) if r not in status]
            live.check()
            failed = [r for r in pending if r not in dead and r in live.dead]
            if self.copies is not None:  # the holder writing a dead rank's copy died
                failed += [r for r in pending if r in dead and (
                    h := self.copies.published(g, r)) is not None and h[0] in live.dead]
            waiting = [r for r in pending if r not in dead or r not in live.closed and (
                live.live_host_mate(r, dead) is not None
                or self.copies is not None and self.copies.published(g, r) is not None)]
            if failed or not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if failed or [r for r in pending if r not in dead]:
            lost = failed or [r for r in pending if r not in dead]
            log.error("step %d NOT committed: rank(s) %s %s during the flush", step, lost,
                      "died" if failed else f"did not finish within {self.flush_timeout_s:.0f} s")
            if failed:  # before the failure is published: every waiter sees it
                self.kv.set(f"{g}/retry", csv(failed))
            return self._fail(g, step, lost)
        try:
            present = self.store.present(step, self.world)
        except Exception as e:  # noqa: BLE001 - an unreachable store: not committed
            log.error("step %d NOT committed: cannot list its parts in %s: %s", step,
                      self.store.url, e)
            return self._fail(g, step, list(range(self.world)))
        missing = [r for r in range(self.world) if r not in present]
        uncovered = [r for r in missing if not any(q in present for q in self.replicas_of(r))]
        if uncovered:
            log.error("step %d NOT committed: no durable files for rank(s) %s and no replica",
                      step, uncovered)
            return self._fail(g, step, uncovered)
        try:
            self.store.commit(step, {
                "step": step, "world_size": self.world, "present": present, "missing": missing,
                "replica_groups": self.replica_groups, "time": time.time(),
                "job": self.local.job, "dead": sorted(dead), "epoch": self.epoch},
                self.local.keep, timeout=self._lock_wait(deadline))
        except (OSError, SnapshotError) as e:
            log.error("step %d NOT committed: writing its COMMIT to %s failed: %s", step,
                      self.store.url, e)
            return self._fail(g, step, [])
        self.kv.set(f"{g}/committed", str(step))
        self.events("committed", gen=self.gen, step=step, present=present)
        log.warning("step %d committed by rank %d (%d/%d ranks present)", step, self.rank,
                    len(present), self.world)
        return True

    def _lock_wait(self, deadline: float) -> float:
        """The commit's wait on ``latest``'s writers: the round's time left, <= the timeout."""
        left = max(0.0, deadline - time.monotonic())
        return left if self._latest_wait is None else min(left, self._latest_wait)

    def _fail(self, g: str, step: int, ranks: list[int]) -> bool:
        self.kv.set(f"{g}/committed", "failed")
        self.events("commit_failed", gen=self.gen, step=step, ranks=ranks)
        return False
