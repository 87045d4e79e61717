"""In-process restart (issue 46): the healthy ranks keep their process; a warm spare takes a
lost rank; the state comes back from the ranks' arenas in shared memory.

Built on torch.distributed's own primitives (docs/design.md §3.10 says why not NVIDIA
resiliency-ext's ``inprocess.Wrapper`` or torchft, measured on this machine):

* a **control store** (a ``TCPStore`` hosted by a process that is not a rank: ``cudasnap run
  --inprocess``, or the caller) holds each process's heartbeat (``hb/<uid>``: time, pid,
  node, ready), the generation ``gen``, its members ``members/<gen>`` (the uid of each rank,
  in rank order), ``join/<gen>/<uid>``, and ``done`` / ``failed`` at the end;
* a **monitor thread** per process beats every ``heartbeat_s`` and checks the members of the
  current generation: a peer on this node (``CUDASNAP_NODE_ID``, default the host name) is
  dead when its pid is gone or a zombie (seen at once), any peer when its heartbeat is older
  than ``stale_s`` (a lost node: its ranks' spares restore from the copies another node
  holds, ``CUDASNAP_NODE_REPLICA``). It then proposes the next generation (the first
  proposal stored wins): the same members, each dead one replaced, in its rank, by a ready
  spare, so a survivor's rank, and so its arena, never changes. No spare left: ``failed``
  is set, the spares leave and the ranks raise NoSpare (``cudasnap run --inprocess`` then
  restarts every process). Once the generation moved on, it aborts this process's NCCL
  groups (which releases a training thread waiting in an NCCL collective);
* the **training thread** leaves its attempt when a collective raises (gloo: the peer's
  socket reset, or the group's ``timeout``, the bound for a rank not connected to the dead
  one), in ``Attempt.wait`` (an async collective) or at ``Attempt.check()`` once the
  generation changed; ``attempts()`` then drops the old groups (``groups.drop_groups``: no
  gloo abort, which holds the GIL until the group's timeout), waits until every member of
  the new generation joined (a group is never formed with a member already lost) and
  initialises its group on ``PrefixStore("pg/<gen>")`` (keys are never reused);
* a **spare** is a process started ahead (interpreter up, torch and cudasnap imported, model
  built) that waits in ``attempts()`` until a generation names it; it then takes the dead
  rank's place, and its Snapshotter finds that rank's arena in shared memory (the job and
  rank name it), or the copy another node holds, and restores from it, like every survivor
  from its own.

The restore itself is the Snapshotter's (``restore_latest``: the ranks agree on the newest
step every rank holds, the bytes go back into the same live objects): ≤ 1 step replayed.

Call order (one process): ``run_inprocess(train)`` (cudasnap.run_inprocess), which does::

    ipr = InProcessRestart()               # CUDASNAP_CONTROL, CUDASNAP_UID, CUDASNAP_WORLD
    for attempt in ipr.attempts():         # a spare waits here until it is needed
        with attempt:                      # a peer's loss ends the attempt, not the process
            snap = Snapshotter(model, opt, directory=D)
            with snap:                     # close() in an exception keeps the arena
                start = snap.restore_latest()
                for step in range(start, steps): ...; attempt.check(); snap.boundary(step)
                snap.flush()
    ipr.close()
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

from .._proc import pid_alive
from .groups import drop_groups, nccl_groups

log = logging.getLogger("cudasnap.inprocess")
T = TypeVar("T")



class PeerLost(RuntimeError):
    """A member of this attempt's process group was lost (or the generation moved on): the
    attempt ends and the next one re-forms the group."""


class NoSpare(RuntimeError):
    """A member was lost and no spare can take its rank: the in-process restart cannot go
    on; the job needs a full restart (``cudasnap run --inprocess`` starts every process
    again, which restore from shared memory)."""


@dataclass
class Attempt:
    """One generation of the job: this process's rank in it; a context that turns the loss of
    a peer (a collective's error, or ``check()`` after the generation moved on) into the end
    of the attempt (``__exit__`` swallows it; ``InProcessRestart.attempts`` forms the next)."""

    gen: int
    rank: int
    world: int
    members: list[int]
    owner: InProcessRestart
    done: bool = False
    lost: BaseException | None = field(default=None, repr=False)

    def check(self) -> None:
        """PeerLost once the job has moved to a later generation (a peer was lost): the
        generation the monitor saw last (no store round trip per step)."""
        if self.owner.seen_gen != self.gen:
            raise PeerLost(f"generation {self.gen} ended: a peer was lost")

    def wait(self, work: object, poll_s: float = 0.0005) -> None:
        """Waits for a collective issued with ``async_op=True``; PeerLost as soon as the
        monitor sees the generation move on. A rank whose gloo peers are all alive but one
        of whose ring neighbours left would otherwise wait in it until the group's timeout
        (hand-written collectives; DDP's and FSDP's own end at that timeout)."""
        while not work.is_completed():  # type: ignore[attr-defined]
            if self.owner.seen_gen != self.gen:
                self.owner.abandoned.append(work)  # its release could wait for the op
                raise PeerLost(f"generation {self.gen} ended: a peer was lost")
            time.sleep(poll_s)
        work.wait()  # type: ignore[attr-defined]  # its error, if it failed

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if e is None:
            self.done = True
            return False
        if not self.owner.is_peer_loss(e, self.gen):
            why = self.owner.failed()
            if why is not None:
                raise NoSpare(f"in-process restart: {why}") from e
            return False
        self.lost = e
        log.warning("in-process restart: generation %d ended on rank %d (%s: %s)", self.gen,
                    self.rank, type(e).__name__, str(e)[:200])
        self.owner.report(self.gen)
        return True


class InProcessRestart:
    """This process's membership in a job that restarts in place (module docstring).

    ``control``/``uid``/``world``: the environment ``cudasnap run --inprocess`` sets when
    None (CUDASNAP_CONTROL, CUDASNAP_UID, CUDASNAP_WORLD; CUDASNAP_NPROC the processes in
    all, spares included); ``heartbeat_s``: the monitor's period; ``stale_s``: a heartbeat
    older than this is a lost process (a lost node is seen so); ``pg_timeout_s``: each
    group's timeout (CUDASNAP_PG_TIMEOUT_S); ``backend``: default NCCL for CUDA tensors and
    gloo for CPU ones where CUDA is available, else gloo; ``spare_start_s``: how long a lost
    rank waits for a spare still starting (its process up, torch not yet imported)."""

    def __init__(self, control: str | None = None, uid: int | None = None,
                 world: int | None = None, heartbeat_s: float = 0.1, stale_s: float = 1.5,
                 pg_timeout_s: float | None = None, backend: str | None = None,
                 spare_start_s: float = 60.0) -> None:
        import torch.distributed as dist

        from ..config import Settings
        from ..errors import ConfigError

        cfg = Settings.from_env()
        addr = control or cfg.control or ""
        host, _, port = addr.rpartition(":")
        uid = cfg.uid if uid is None else uid
        world = cfg.world if world is None else world
        if not host or not port.isdigit() or uid is None or not world:
            raise ConfigError(
                "in-process restart needs the control store's host:port (CUDASNAP_CONTROL), "
                f"this process's id (CUDASNAP_UID) and the ranks (CUDASNAP_WORLD); got "
                f"{addr!r}, {uid!r}, {world!r}")
        self.uid, self.world = int(uid), int(world)
        self.nproc = cfg.nproc or self.world
        self.node = cfg.node  # whose pids this process can see
        import torch

        self.heartbeat_s, self.stale_s, self.spare_start_s = heartbeat_s, stale_s, spare_start_s
        self.backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout_s or cfg.pg_timeout_s)
        self._old_groups: list[object] = []  # kept until their operations timed out
        self._dropped_at: float | None = None
        self.abandoned: list[object] = []  # collectives left in flight (Attempt.wait)

        def client() -> dist.TCPStore:
            return dist.TCPStore(host, int(port), is_master=False,
                                 timeout=datetime.timedelta(seconds=60))

        self._store, self._mon = client(), client()  # the monitor thread has its own
        self._ready = False  # waiting in attempts() (a spare may be handed a rank)
        self._store.compare_set("gen", "", "0")
        self._store.compare_set("members/0", "", json.dumps(list(range(self.world))))
        self._beat(self._store)
        self._said: set[int] = set()  # generations whose lack of spares was logged
        self._short: dict[int, float] = {}  # generation -> when a spare was first lacking
        self.seen_gen = 0  # the generation the monitor saw last (Attempt.wait polls it)
        self._attempt_gen: int | None = None  # the attempt this process is in (_release)
        self._released: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="cudasnap-inprocess",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ membership
    def generation(self, store: object | None = None) -> int:
        s = self._store if store is None else store
        return int(s.get("gen"))  # type: ignore[attr-defined]

    def members(self, gen: int, store: object | None = None) -> list[int]:
        s = self._store if store is None else store
        return [int(u) for u in json.loads(s.get(f"members/{gen}"))]  # type: ignore[attr-defined]

    def _beat(self, s: object) -> None:
        s.set(f"hb/{self.uid}", f"{time.time()},{os.getpid()},{self.node},"  # type: ignore[attr-defined]
              f"{int(self._ready)}")

    def _alive(self, u: int, s: object, now: float, ready: bool = False) -> bool:
        """Whether process ``u`` lives (``ready``: and waits in ``attempts()``, a spare
        that can join a group now). Dead: its launcher saw it end (``gone/<u>``); on this
        node, its pid gone (or a zombie; a live pid is alive however late its beat: a hung
        one is the group timeout's); on another, neither its own heartbeat nor its
        launcher's for it (``lhb/<u>``) newer than ``stale_s``. The launcher's beat keeps a
        process whose training thread holds the GIL (a gloo group connecting to a slow peer
        holds it until the peer comes) from looking dead."""
        if u == self.uid:
            return True
        if s.check([f"gone/{u}"]):  # type: ignore[attr-defined]
            return False
        if not s.check([f"hb/{u}"]):  # type: ignore[attr-defined]
            return not ready  # a member still starting (no beat yet) is not dead
        ts, pid, rest = s.get(f"hb/{u}").decode().split(",", 2)  # type: ignore[attr-defined]
        host, rdy = rest.rsplit(",", 1)  # a node id may hold a comma
        if host == self.node:  # its pid is the truth here: a busy process is not a lost one
            return pid_alive(int(pid)) and (rdy == "1" or not ready)
        age = now - float(ts)
        if age > self.stale_s and s.check([f"lhb/{u}"]):  # type: ignore[attr-defined]
            age = now - float(s.get(f"lhb/{u}"))  # type: ignore[attr-defined]
        return age <= self.stale_s and (rdy == "1" or not ready)

    def _propose(self, gen: int, s: object) -> bool:
        """The next generation after ``gen`` when a member is dead: each dead member
        replaced in its rank by a live spare (lowest uid first). False: nobody is dead, or
        no spare is left (the job then needs a full restart)."""
        old = self.members(gen, s)
        now = time.time()
        dead = [u for u in old if not self._alive(u, s, now)]
        if not dead:
            return False
        spares = sorted(u for u in range(self.nproc)
                        if u not in old and self._alive(u, s, now, ready=True))
        if len(spares) < len(dead):
            starting = [u for u in range(self.nproc)  # alive, not yet in attempts()
                        if u not in old and u not in spares and self._alive(u, s, now)]
            since = self._short.setdefault(gen, now)
            if len(spares) + len(starting) >= len(dead) and now - since < self.spare_start_s:
                return False  # a spare still importing is a spare: wait for it (bounded)
            why = (f"rank(s) {[old.index(u) for u in dead]} of generation {gen} lost and "
                   f"{len(spares)} spare(s) left: the job needs a full restart")
            s.compare_set("failed", "", why)  # type: ignore[attr-defined]  # spares go; ranks raise
            if gen not in self._said:
                self._said.add(gen)
                log.error("in-process restart: %s", why)
            return False
        take = iter(spares)
        new = [u if u not in dead else next(take) for u in old]
        s.compare_set(f"members/{gen + 1}", "", json.dumps(new))  # type: ignore[attr-defined]
        won = s.compare_set("gen", str(gen), str(gen + 1)).decode()  # type: ignore[attr-defined]
        if won == str(gen + 1):
            log.warning("in-process restart: generation %d: rank(s) %s lost, taken by spare "
                        "uid(s) %s", gen + 1, [old.index(u) for u in dead],
                        [new[old.index(u)] for u in dead])
        return True

    def _monitor(self) -> None:
        s = self._mon
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat(s)
                self.seen_gen = self.generation(s)
                self._propose(self.seen_gen, s)  # a spare too: every member may be lost
                self.seen_gen = self.generation(s)
                self._release(self.seen_gen)
            except Exception as e:  # noqa: BLE001 - the control store gone: the job ends
                log.debug("in-process monitor: %s", e)

    def _release(self, gen: int) -> None:
        """Once the job moved past the attempt this process is in: its groups' NCCL backends
        aborted (``abort()``: ncclCommAbort, safe from this thread), which ends a wait of
        the training thread in a collective whose peer is gone; NCCL would otherwise wait
        for its timeout (10 min by default). Gloo's groups are not aborted (its abort holds
        the GIL until the group's timeout: ``groups.drop_groups``); a gloo collective with a lost
        peer fails on its own, or ``Attempt.wait`` leaves it."""
        cur = self._attempt_gen
        if cur is None or gen == cur or self._released == cur:
            return
        self._released = cur
        groups = nccl_groups()
        for be in groups:
            try:
                be.abort()  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - one group's failure leaves the rest
                log.warning("in-process restart: aborting an NCCL group failed: %s", e)
        if groups:
            log.warning("in-process restart: generation %d ended: %d NCCL group(s) aborted "
                        "to release the training thread", cur, len(groups))

    def failed(self) -> str | None:
        """Why the in-process restart gave up (a rank lost, no spare left), else None."""
        s = self._store
        return s.get("failed").decode() if s.check(["failed"]) else None

    def report(self, gen: int) -> None:
        """A collective failed in generation ``gen``: check the members now (the monitor
        would within ``heartbeat_s``)."""
        deadline = time.monotonic() + self.stale_s + 1.0
        while self.generation() == gen and (time.monotonic() < deadline or (
                gen in self._short and time.time() - self._short[gen] < self.spare_start_s)):
            if self._propose(gen, self._store) or self.failed() is not None:
                return
            time.sleep(self.heartbeat_s / 2)

    def is_peer_loss(self, e: BaseException, gen: int) -> bool:
        """Whether exception ``e`` ended generation ``gen`` because of a lost peer: a
        PeerLost, or a collective's error (torch.distributed's) in a generation that has
        moved on or moves on within ``stale_s`` (a real error of the program stays one)."""
        import torch.distributed as dist

        if isinstance(e, PeerLost):
            return True
        if not isinstance(e, (RuntimeError, dist.DistError)):
            return False
        self.report(gen)
        return self.generation() != gen

    # ------------------------------------------------------------ attempts
    def attempts(self) -> Iterator[Attempt]:
        """One Attempt per generation this process is a member of, its process group formed
        (a spare waits for one); ends after an attempt that finished without a peer loss."""
        import torch.distributed as dist

        seen = -1
        self._ready = True
        self._beat(self._store)
        while True:
            gen = self.generation()
            members = self.members(gen)
            if gen == seen or self.uid not in members:
                if self._store.check(["done"]):
                    log.info("in-process restart: the job ended; spare uid %d not needed",
                             self.uid)
                    return
                if (why := self.failed()) is not None:
                    raise NoSpare(f"in-process restart: {why}")
                time.sleep(0.02)
                continue
            seen = gen
            self.seen_gen = max(self.seen_gen, gen)  # before the monitor's next beat
            if dist.is_initialized():
                self._old_groups += drop_groups()
                self._dropped_at = time.monotonic()
            if not self._form(gen, members):
                continue  # a member of it was lost before it formed: the next one
            rank = members.index(self.uid)
            a = Attempt(gen, rank, len(members), members, self)
            self._attempt_gen = gen
            try:
                yield a
            finally:
                self._attempt_gen = None
            if a.done:
                self._store.set("done", str(gen))  # the spares still waiting can go
                return
            if a.lost is None:  # the body raised something else: not ours to swallow
                return

    def _joined(self, gen: int, members: list[int]) -> bool:
        """Every member of generation ``gen`` is here (True), or the generation moved on
        before they all came (False: a member was lost meanwhile; the monitor proposed the
        next). A member that neither comes nor is seen dead within the group timeout is a
        hang the job cannot pass: RuntimeError, naming it."""
        self._store.set(f"join/{gen}/{self.uid}", str(os.getpid()))
        keys = [f"join/{gen}/{u}" for u in members]
        deadline = time.monotonic() + self.pg_timeout.total_seconds()
        while not self._store.check(keys):
            if self.generation() != gen:
                return False
            if time.monotonic() > deadline:
                missing = [members.index(u) for u in members
                           if not self._store.check([f"join/{gen}/{u}"])]
                raise RuntimeError(
                    f"in-process restart: generation {gen}: rank(s) {missing} neither joined "
                    f"nor were seen dead within {self.pg_timeout.total_seconds():.0f} s "
                    "(CUDASNAP_PG_TIMEOUT_S): a hung process the job cannot replace")
            time.sleep(0.005)
        return True

    def _form(self, gen: int, members: list[int]) -> bool:
        """The process group of generation ``gen`` formed (True) once all its members joined
        (``_joined``: a group is never started with a member already lost, whose formation
        would wait out the group timeout); False when the generation moved on first, or a
        member was lost while it formed."""
        import torch.distributed as dist

        t0 = time.monotonic()
        if not self._joined(gen, members):
            return False
        rank = members.index(self.uid)
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"pg/{gen}", self._store),
                                    rank=rank, world_size=len(members), timeout=self.pg_timeout)
        except (RuntimeError, dist.DistError) as e:
            if not self.is_peer_loss(e, gen):
                raise
            log.warning("in-process restart: generation %d lost a member while it formed (%s)",
                        gen, str(e)[:200])
            return False
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(len(members)))  # for who reads them
        log.info("in-process restart: generation %d, rank %d of %d (uid %d), group formed in "
                 "%.3f s", gen, rank, len(members), self.uid, time.monotonic() - t0)
        return True

    def close(self) -> None:
        """Stops the monitor, lets the old groups' operations time out (a gloo thread still
        in an abandoned operation when the interpreter exits ends the process with
        SIGABRT; at most the group timeout after the last restart), destroys the group."""
        self._stop.set()
        self._thread.join(timeout=2)
        if self._dropped_at is not None:  # an old group's op may still wait for its timeout
            time.sleep(max(0.0, self._dropped_at + self.pg_timeout.total_seconds() + 1
                           - time.monotonic()))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_inprocess(train: Callable[[Attempt], T], **options: object) -> T | None:
    """The one wrapper: ``train(attempt)`` called once per generation this process is a
    member of (a spare first waits for one), inside the attempt, so the loss of a peer ends
    the call, not the process; returns what the last call returned (None for a spare never
    needed). ``train`` builds its Snapshotter and restores at its start (the survivors from
    their own arenas, a spare from the lost rank's), as it would after a process restart.
    ``options``: InProcessRestart's keywords (default: the environment ``cudasnap run
    --inprocess`` sets). Raises NoSpare when a rank is lost and no spare is left."""
    ipr = InProcessRestart(**options)  # type: ignore[arg-type]
    out: T | None = None
    try:
        for attempt in ipr.attempts():
            with attempt:
                out = train(attempt)
    finally:
        ipr.close()
    return out

