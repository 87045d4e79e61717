"""In-process restart (issue 46): the healthy ranks keep their process; a warm spare takes a
lost rank; the state comes back from the ranks' arenas in shared memory.

Built on torch.distributed's own primitives (docs/design.md §3.10 says why not NVIDIA
resiliency-ext's ``inprocess.Wrapper`` or torchft, measured on this machine):

* a **control store** (a ``TCPStore`` hosted by a process that is not a rank: ``cudasnap run
  --inprocess``, or the caller) holds each process's heartbeat (``hb/<uid>``: time, pid,
  host), the generation ``gen`` and its members ``members/<gen>`` (the uid of each rank, in
  rank order);
* a **monitor thread** per process beats every ``heartbeat_s`` and checks the members of the
  current generation: a peer on this host is dead when its pid is gone or a zombie (seen at
  once), any peer when its heartbeat is older than ``stale_s``. It then proposes the next
  generation (the first proposal stored wins): the same members, each dead one replaced, in
  its rank, by a live spare, so a survivor's rank, and so its arena, never changes;
* the **training thread** leaves its attempt when a collective raises (gloo: the peer's
  socket reset, or the group's ``timeout``, the bound for a rank not connected to the dead
  one) or at the next ``check()`` after the generation changed; ``attempts()`` then aborts
  the process group (``_abort_process_group``: it does not wait for an op a gloo thread is
  stuck in) and initialises one for the new generation on ``PrefixStore("pg/<gen>")``
  (keys are never reused), with the rank the members list gives;
* a **spare** is a process started ahead (interpreter up, torch and cudasnap imported, model
  built) that waits in ``attempts()`` until a generation names it; it then takes the dead
  rank's place, and its Snapshotter finds that rank's arena in shared memory (the job and
  rank name it) and restores from it, like every survivor from its own.

The restore itself is the Snapshotter's (``restore_latest``: the ranks agree on the newest
step every rank holds, the bytes go back into the same live objects): ≤ 1 step replayed.

Call order (one process)::

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType

from .._proc import pid_alive

log = logging.getLogger("cudasnap.inprocess")

_HOST = os.uname().nodename


class PeerLost(RuntimeError):
    """A member of this attempt's process group was lost (or the generation moved on): the
    attempt ends and the next one re-forms the group."""


def _drop_groups() -> list[object]:
    """Every process group of this process forgotten now; returns them, to be kept.

    ``_abort_process_group()`` calls each group's ``abort()``, and gloo's waits for an
    operation still in flight (one this rank left when a peer was lost: its ring neighbour
    never sends) until the group's timeout, holding the GIL (every thread of the process
    stops: 10 s of a 4-rank recovery, measured). So the bookkeeping it does after that
    (torch.distributed's ``_world``) is done here, as it does it, and no ``abort()`` is
    called: the old groups are kept alive (a release would wait alike) until their
    operations have timed out (``InProcessRestart.close``). A torch whose ``_world``
    differs gets the blocking call."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    w = c10d._world
    try:
        old: list[object] = list(w.pg_names)
        c10d._update_default_pg(None)
        for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config,
                      w.pg_to_tag, w.tags_to_pg, w.pg_coalesce_state):
            table.clear()
        c10d._unregister_all_process_groups()
        w.group_count = 0
    except AttributeError as e:
        log.debug("in-process restart: blocking abort (%s)", e)
        c10d._abort_process_group()
        return []
    return old


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
            return False
        self.lost = e
        log.warning("in-process restart: generation %d ended on rank %d (%s: %s)", self.gen,
                    self.rank, type(e).__name__, str(e)[:200])
        self.owner.report(self.gen)
        return True


class InProcessRestart:
    """This process's membership in a job that restarts in place (module docstring)."""

    def __init__(self, control: str | None = None, uid: int | None = None,
                 world: int | None = None, heartbeat_s: float = 0.1, stale_s: float = 1.5,
                 pg_timeout_s: float | None = None, backend: str = "gloo") -> None:
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
        self.heartbeat_s, self.stale_s, self.backend = heartbeat_s, stale_s, backend
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
        self.seen_gen = 0  # the generation the monitor saw last (Attempt.wait polls it)
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
        s.set(f"hb/{self.uid}", f"{time.time()},{os.getpid()},{_HOST},"  # type: ignore[attr-defined]
              f"{int(self._ready)}")

    def _alive(self, u: int, s: object, now: float, ready: bool = False) -> bool:
        """Whether process ``u`` lives (``ready``: and waits in ``attempts()``, a spare
        that can join a group now)."""
        if u == self.uid:
            return True
        if not s.check([f"hb/{u}"]):  # type: ignore[attr-defined]
            return not ready  # a member still starting (no beat yet) is not dead
        ts, pid, host, rdy = s.get(f"hb/{u}").decode().split(",")  # type: ignore[attr-defined]
        if host == _HOST and not pid_alive(int(pid)):
            return False  # SIGKILLed on this host: seen at once
        return now - float(ts) <= self.stale_s and (rdy == "1" or not ready)

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
            if gen not in self._said:
                self._said.add(gen)
                log.error("in-process restart: rank(s) %s lost and %d spare(s) left: the job "
                          "needs a full restart", [old.index(u) for u in dead], len(spares))
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
                gen = self.seen_gen = self.generation(s)
                if self.uid in self.members(gen, s):
                    self._propose(gen, s)
                    self.seen_gen = self.generation(s)
            except Exception as e:  # noqa: BLE001 - the control store gone: the job ends
                log.debug("in-process monitor: %s", e)

    def report(self, gen: int) -> None:
        """A collective failed in generation ``gen``: check the members now (the monitor
        would within ``heartbeat_s``)."""
        deadline = time.monotonic() + self.stale_s + 1.0
        while self.generation() == gen and time.monotonic() < deadline:
            if self._propose(gen, self._store):
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
                time.sleep(0.02)
                continue
            seen = gen
            self.seen_gen = max(self.seen_gen, gen)  # before the monitor's next beat
            if dist.is_initialized():
                self._old_groups += _drop_groups()
                self._dropped_at = time.monotonic()
            t0 = time.monotonic()
            rank = members.index(self.uid)
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"pg/{gen}", self._store),
                                    rank=rank, world_size=len(members), timeout=self.pg_timeout)
            log.info("in-process restart: generation %d, rank %d of %d (uid %d), group formed "
                     "in %.3f s", gen, rank, len(members), self.uid, time.monotonic() - t0)
            a = Attempt(gen, rank, len(members), members, self)
            yield a
            if a.done:
                self._store.set("done", str(gen))  # the spares still waiting can go
                return
            if a.lost is None:  # the body raised something else: not ours to swallow
                return

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
