"""Node-loss replication: each rank's newest snapshot also lives in another node's memory.

On (``CUDASNAP_NODE_REPLICA=1``), every rank of a multi-rank job runs a ``Replicator``,
started by its Coordinator:

- a **server** thread listens on a TCP port (``CUDASNAP_REPLICA_ADDR``; published in the
  store with a random per-process token that every request must carry) and serves two
  requests, each on its own thread: ``put`` (a partner's snapshot lands in a guest arena of
  this node's shared memory, checked chunk by chunk against the CRC32C table that travels
  with it: cudasnap.distributed.replica_store) and ``get`` (a copy this node holds is sent back to
  a rank that lost its node, for its restore);
- a **sender** thread watches this rank's arena for a newer COMPLETE slot, leases it, and
  sends it (meta, CRC table, data: cudasnap.distributed.replica_wire) to its partner. The
  training thread never waits for it. One transfer at a time: snapshots completed while one
  is in flight are skipped (``stats()["skipped"]``), so the replica is at most one snapshot
  behind plus the one in flight. The send pauses while a flush of this process writes, and
  ``CUDASNAP_REPLICA_MAX_MBPS`` caps its rate. It starts with this process's first
  ``boundary()``: a restore (perhaps fetching a copy) has the cores until then.

**Partners are chosen by node** (``CUDASNAP_NODE_ID``, default the host name): the nodes,
ordered by their lowest rank, form a ring; the j-th rank of a node sends to the
(j mod n)-th rank of the next node. A node's ranks never replicate to their own node; a
job on one node replicates nothing (logged once).

Restore (cudasnap.distributed.restore_vote) counts every copy a node holds as a candidate: a rank
whose node was replaced fetches its copy from the holder (``fetch``) into a temporary arena
of its own shared memory, restores from it like from its own slot, and removes it.
"""
from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..errors import ConfigError, SnapshotError
from .kv import KV
from .local import LocalSnapshots
from .replica_store import (
    GuestStore,
    claim_guests,
    clean_leftovers,
    fetch_path,
    find_slot,
    held_steps,
    make_arena,
    sweep,
)
from .replica_wire import Throttle, WireError, configure, land, recv_msg, send_msg, send_slot, slot_header

if TYPE_CHECKING:
    from cudasnap._C import Arena

    from .parity_rounds import ParityKeeper

log = logging.getLogger("cudasnap.distributed")

_POLL_S = 0.02
_IO_TIMEOUT_S = 60.0
_MAX_CONNS = 32


def default_addr() -> str:
    """This host's address on the route to MASTER_ADDR (what peers reach), else loopback."""
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
            s.connect((master, 9))  # no packet is sent: this picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _background() -> None:
    """This thread (and the threads it starts: the CRC check's) at nice 10, as the copy
    engine's workers: the training thread and the step's own traffic come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):  # not Linux, or not allowed: the default priority
        pass


def ring_partner(nodes: dict[int, str], rank: int) -> int | None:
    """The rank ``rank`` replicates to: the next node in the ring (nodes ordered by their
    lowest rank), its (j mod n)-th rank for this node's j-th rank; None on one node."""
    order: list[str] = []
    for r in sorted(nodes):
        if nodes[r] not in order:
            order.append(nodes[r])
    if len(order) < 2:
        return None
    mine = nodes[rank]
    nxt = order[(order.index(mine) + 1) % len(order)]
    here = sorted(r for r in nodes if nodes[r] == mine)
    there = sorted(r for r in nodes if nodes[r] == nxt)
    return there[here.index(rank) % len(there)]


class Replicator:
    def __init__(self, kv: KV, local: LocalSnapshots, settings: Settings) -> None:
        cfg = settings  # the coordinator's (read by the Snapshotter when it started)
        self.kv, self.local = kv, local
        self.rank, self.world, self.job = local.rank, local.world_size, local.job
        self.own_path = local.arena_path_of(self.rank)
        self.shm = self.own_path.parent
        self.node = cfg.node
        self.rate = cfg.replica_max_mbps * 1e6 if cfg.replica_max_mbps else None
        self.threads = max(1, min(4, local.flush_threads))
        self.guests = GuestStore(self.shm, self.job, self.threads)
        gone = clean_leftovers(self.shm, self.job, guests=cfg.fresh)
        if cfg.fresh:  # parity files too (cudasnap.distributed.parity)
            from .parity import drop_parity_newer

            drop_parity_newer(self.shm, self.job, -1)
        claim_guests(self.shm, self.job)  # held for this job's restore, not `cudasnap gc`'s
        if gone:
            log.warning("rank %d: removed %d replica arena(s) from %s%s", self.rank, len(gone),
                        self.shm, " (fresh start)" if cfg.fresh else " left by dead processes")
        self._token = secrets.token_hex(16)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns = threading.BoundedSemaphore(_MAX_CONNS)  # requests served at once
        self._stats: dict[str, Any] = {
            "partner": None, "sent": 0, "skipped": 0, "failed": 0, "bytes": 0, "seconds": 0.0,
            "sent_step": None, "in_flight_step": None, "received": 0, "received_bytes": 0,
            "served": 0, "fetched": 0}
        self._rates: collections.deque[float] = collections.deque(maxlen=32)
        addr = cfg.replica_addr or default_addr()
        try:
            self._srv = socket.create_server((addr, 0), backlog=16)
        except OSError as e:
            raise ConfigError(f"node-loss replication: cannot listen on {addr!r} ({e}); set "
                              "CUDASNAP_REPLICA_ADDR to an address of this host") from None
        self._srv.settimeout(0.2)
        self.addr = f"{addr}:{self._srv.getsockname()[1]}"
        kv.set(f"replica/node/{self.rank}", self.node)
        kv.set(f"replica/addr/{self.rank}", f"{self.addr}:{self._token}")
        self._nodes: dict[int, str] | None = None
        # node_replica="xor:K": parity rounds instead of full copies (cudasnap.distributed.parity_rounds)
        self.parity: ParityKeeper | None = None
        if cfg.node_parity >= 2:
            from .parity_rounds import ParityKeeper

            self.parity = ParityKeeper(self, cfg.node_parity)
        self._server = threading.Thread(target=self._serve, name="cudasnap-replica-server",
                                        daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="cudasnap-replica-sender",
                                        daemon=True)
        self._server.start()
        self._sender.start()
        log.info("rank %d (node %s): replica server on %s", self.rank, self.node, self.addr)

    # ------------------------------------------------------------ views
    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self._stats)
            rates = sorted(self._rates)
        s["mb_per_s"] = s["bytes"] / s["seconds"] / 1e6 if s["seconds"] else None
        s["mb_per_s_median"] = rates[len(rates) // 2] if rates else None  # last 32 transfers
        if self.parity is not None:
            s.update(self.parity.stats())
        return s

    @property
    def stopping(self) -> threading.Event:
        """Set once stop() began (the parity rounds end with it)."""
        return self._stop

    def parity_held(self) -> list[dict[str, Any]]:
        """The parity files this node holds (their trailers), for the restore vote."""
        from .parity import held_parity

        return held_parity(self.shm, self.job)

    def nodes(self, timeout: float = 0.0) -> dict[int, str] | None:
        """Every rank's node id (None until all ranks published theirs)."""
        end = time.monotonic() + timeout
        while self._nodes is None:
            got = {r: self.kv.get(f"replica/node/{r}") for r in range(self.world)}
            if all(v is not None for v in got.values()):
                self._nodes = {r: str(v) for r, v in got.items()}
                break
            if time.monotonic() >= end or self._stop.wait(0.1):
                return None
        return self._nodes

    def held(self) -> dict[int, list[int]]:
        """Steps of every copy this node holds, by source rank (this rank's own arena aside)."""
        return held_steps(self.shm, self.job, self.own_path)

    def _peer(self, rank: int) -> tuple[str, int, str]:
        v = self.kv.get(f"replica/addr/{rank}")
        if v is None:
            raise WireError(f"rank {rank} published no replica server")
        host, port, token = v.rsplit(":", 2)
        return host, int(port), token

    def connect(self, rank: int) -> tuple[socket.socket, str]:
        """A connection to ``rank``'s replica server and the token its requests carry."""
        host, port, token = self._peer(rank)
        sock = socket.create_connection((host, port), timeout=_IO_TIMEOUT_S)
        configure(sock, _IO_TIMEOUT_S)
        try:  # DSCP CS1 ("lower effort"): where the network honours it, the step's traffic wins
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0x20)
        except OSError:
            pass
        return sock, token

    # ------------------------------------------------------------ sender
    def _send_loop(self) -> None:
        _background()
        if self.parity is not None:
            self.parity.run()
            return
        partner: int | None = None
        last: tuple[str, int] | None = None
        backoff = 0.0
        while not self._stop.wait(_POLL_S + backoff):
            if partner is None:
                nodes = self.nodes(timeout=0.0)
                if nodes is None:
                    continue
                partner = ring_partner(nodes, self.rank)
                if partner is None:
                    log.warning("rank %d: every rank runs on node %s: node-loss replication "
                                "has no other node to copy to", self.rank, self.node)
                    return
                with self._lock:
                    self._stats["partner"] = partner
                log.info("rank %d (node %s) replicates to rank %d (node %s)", self.rank,
                         self.node, partner, nodes[partner])
            if self.local.last_step() is None:
                continue  # until training runs: a restore (maybe a fetch) has the cores
            arenas = self.local.arenas()
            if not arenas:
                continue
            arena = arenas[0]
            slot = arena.newest_complete()
            if slot < 0:
                continue
            info = arena.slot_info(slot)
            key = (arena.path, int(info["seq"]))
            if key == last:
                continue
            if last is not None and last[0] == key[0] and key[1] - last[1] > 1:
                with self._lock:  # snapshots completed while the previous one was sent
                    self._stats["skipped"] += key[1] - last[1] - 1
            last = key
            try:
                self._send(arena, slot, partner)
                backoff = 0.0
            except (OSError, SnapshotError) as e:
                if self._stop.is_set():
                    return
                with self._lock:
                    self._stats["failed"] += 1
                    self._stats["in_flight_step"] = None
                backoff = min(2.0, backoff * 2 or 0.1)
                log.warning("rank %d: replica of step %d to rank %d failed: %s", self.rank,
                            info["step"], partner, e)

    def _send(self, arena: Arena, slot: int, partner: int) -> None:
        arena.lease(slot)
        try:
            info = arena.slot_info(slot)
            if not info["valid"]:
                return  # overwritten between the pick and the lease
            hdr = slot_header(arena, slot)
            with self._lock:
                self._stats["in_flight_step"] = hdr["step"]
            sock, token = self.connect(partner)
            with sock:
                hdr.update(op="put", token=token, job=self.job, src=self.rank, node=self.node)
                t0 = time.perf_counter()
                n = send_slot(sock, arena, slot, hdr, Throttle(self.rate), self._stop)
                reply = recv_msg(sock)
                secs = time.perf_counter() - t0
            if not reply.get("ok"):
                raise WireError(f"rank {partner} refused the replica: {reply.get('error')}")
        finally:
            arena.release(slot)
        with self._lock:
            s = self._stats
            s["sent"] += 1
            s["bytes"] += n
            s["seconds"] += secs
            s["sent_step"] = hdr["step"]
            s["in_flight_step"] = None
            if secs > 0:
                self._rates.append(n / secs / 1e6)
        log.debug("rank %d: step %d replicated to rank %d (%d bytes, %.3f s)", self.rank,
                  hdr["step"], partner, n, secs)

    # ------------------------------------------------------------ server
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._conns.acquire(blocking=False):  # a flood of connections: refused
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True,
                             name="cudasnap-replica-conn").start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._handle_one(conn)
        finally:
            self._conns.release()

    def _handle_one(self, conn: socket.socket) -> None:
        _background()
        with conn:
            configure(conn, _IO_TIMEOUT_S)
            try:
                hdr = recv_msg(conn)
                if not hmac.compare_digest(str(hdr.get("token", "")), self._token):
                    raise WireError("bad token")
                if hdr.get("job") != self.job:
                    raise WireError(f"job {hdr.get('job')!r} is not {self.job!r}")
                src = int(hdr["src"])
                if not 0 <= src < 1 << 20:
                    raise WireError(f"bad source rank {src}")
                if hdr.get("op") == "put":
                    step = self.guests.receive(conn, hdr, src)
                    with self._lock:
                        self._stats["received"] += 1
                        self._stats["received_bytes"] += int(hdr["data_bytes"])
                    send_msg(conn, {"ok": True, "step": step})
                elif hdr.get("op") == "get":
                    self._serve_copy(conn, src, int(hdr["step"]))
                elif hdr.get("op") in ("xput", "xget") and self.parity is not None:
                    if hdr["op"] == "xput":
                        self.parity.serve_put(conn, hdr)
                    else:
                        self.parity.serve_get(conn, hdr)
                else:
                    raise WireError(f"unknown request {hdr.get('op')!r}")
            except (OSError, SnapshotError, KeyError, TypeError, ValueError) as e:
                if not self._stop.is_set():
                    log.warning("rank %d: replica request failed: %s", self.rank, e)
                try:
                    send_msg(conn, {"ok": False, "error": str(e)[:2000]})
                except OSError:
                    pass

    def _serve_copy(self, conn: socket.socket, src: int, step: int) -> None:
        found = find_slot(self.shm, self.job, src, step)
        if found is None:
            send_msg(conn, {"ok": False, "error": f"no copy of rank {src} step {step} on node "
                                                  f"{self.node}"})
            return
        arena, slot = found
        arena.lease(slot)
        try:
            if not arena.slot_info(slot)["valid"]:
                raise WireError(f"the copy of rank {src} step {step} changed while served")
            hdr = slot_header(arena, slot)
            hdr.update(ok=True, src=src)
            send_slot(conn, arena, slot, hdr, None, self._stop, yield_to_flush=False)
        finally:
            arena.release(slot)
        with self._lock:
            self._stats["served"] += 1

    # ------------------------------------------------------------ restore side
    def fetch(self, holder: int, src: int, step: int) -> tuple[Arena, int, Path]:
        """The copy of ``src``'s ``step`` held by ``holder``'s node, landed in a temporary
        arena of this node's shared memory: (arena, slot, path); the caller removes it."""
        sock, token = self.connect(holder)
        path = fetch_path(self.shm, self.job, self.rank)
        with sock:
            send_msg(sock, {"op": "get", "token": token, "job": self.job, "src": src,
                            "step": step})
            hdr = recv_msg(sock)
            if not hdr.get("ok"):
                raise WireError(f"rank {holder}: {hdr.get('error')}")
            if int(hdr.get("step", -1)) != step or int(hdr.get("src", -1)) != src:
                raise WireError(f"rank {holder} sent another copy than asked for")
            try:
                arena = make_arena(path, hdr, self.job, exact=True)
                slot = land(sock, hdr, arena, self.threads)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        with self._lock:
            self._stats["fetched"] += 1
        return arena, slot, path

    def stop(self, clean: bool = False) -> None:
        """Stops the threads; ``clean`` (the job ended with its final step committed):
        the guest copies this process received are removed from shared memory, and every
        arena of the job there that this process holds or whose holder is gone (own
        arenas of renumbered ranks, guests claimed at start: replica_store.sweep); this
        rank's own arena is its Snapshotter's to remove."""
        self._stop.set()
        try:
            self._srv.close()
        except OSError:
            pass
        for t in (self._sender, self._server):
            if t is not threading.current_thread():
                t.join(timeout=10)
        gone_parity = self.parity.stop(clean) if self.parity is not None else []
        if clean:
            gone = self.guests.close() + sweep(self.shm, self.job, keep=self.own_path) + gone_parity
            if gone:
                log.info("rank %d: clean end: removed %d replica arena(s) from %s: %s",
                         self.rank, len(gone), self.shm, ", ".join(sorted(p.name for p in gone)))
