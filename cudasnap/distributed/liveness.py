"""Peer liveness: heartbeats in the store, and which peers are dead.

Every ``heartbeat_s`` the monitor publishes ``hb/<rank> = seq:last_step:complete_steps``
and reads the others'. A peer is dead when its heartbeat stops for
``peer_timeout_s`` (a SIGSTOPped or otherwise frozen process) or, once its heartbeat
lags, at once when its presence port (a listening socket its process holds) refuses a
connection: its process is gone, on this node or another, whatever pid namespace or
container it ran in. No pid is looked up. A peer that never sent a heartbeat is not
timed out (it may still be starting).

A rank that ends cleanly (``close()`` with its final snapshot committed) replaces its
heartbeat by ``hb/<rank> = closed:<step>`` before it stops: its peers then count it as
closed, not dead. Its silence, and its process exiting, trigger nothing (the end of a
job is not a peer failure); a flush round does not wait for it (see flush_round).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable

from ..config import default_node_id
from ..errors import ConfigError
from .kv import KV

log = logging.getLogger("cudasnap.distributed")

CLOSED = "closed:"  # prefix of the heartbeat of a rank that closed cleanly


class Presence:
    """This process's presence port: a listening TCP socket that lives exactly as long as the
    process (the kernel closes it at the exit, a SIGKILL or a zombie's included; a forked
    child closes its copy at once, see ``_close_in_children``). A peer that connects to it
    learns, across pid namespaces, containers and nodes alike, whether the process is
    there: a refused connection means it is gone; a connection accepted means a process
    listens (a frozen one too: the heartbeat's silence covers that). No pid is looked up."""

    def __init__(self, addr: str) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.create_server((addr, 0), family=family, backlog=128)
        self.sock.setblocking(False)
        host, port = self.sock.getsockname()[:2]  # numeric: a probe never resolves a name
        self.addr = f"{host}:{port}"
        _PRESENCE.add(self.sock)
        _close_in_children()

    def drain(self) -> None:
        """Closes the connections probes opened (the kernel accepted them; a full backlog
        would make later probes time out)."""
        for _ in range(256):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, OSError):
                return
            conn.close()

    def close(self) -> None:
        _PRESENCE.discard(self.sock)
        self.sock.close()


_PRESENCE: weakref.WeakSet[socket.socket] = weakref.WeakSet()
_FORK_HOOK = [False]


def _close_in_children() -> None:
    """A child forked by this process (a DataLoader worker) closes its copies of the
    presence ports: the port must not outlive the process that published it."""
    if _FORK_HOOK[0]:
        return
    _FORK_HOOK[0] = True

    def child() -> None:
        for s in list(_PRESENCE):
            try:
                s.close()
            except OSError:
                pass
    os.register_at_fork(after_in_child=child)


UP, REFUSED, UNKNOWN = "up", "refused", "unknown"


def probe(addrs: dict[int, str], timeout_s: float) -> dict[int, str]:
    """Connects to every ``host:port`` of ``addrs`` at once (non-blocking), for at most
    ``timeout_s`` in all: rank -> UP (accepted), REFUSED (nothing listens: ECONNREFUSED)
    or UNKNOWN (no answer in time, unreachable, a bad address)."""
    out = dict.fromkeys(addrs, UNKNOWN)
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for r, a in addrs.items():
            host, _, port = a.rpartition(":")
            try:
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM)
            except OSError:
                continue
            socks.append(s)
            s.setblocking(False)
            try:
                err = s.connect_ex((host, int(port)))
            except (OSError, ValueError):
                continue
            if err == 0:
                out[r] = UP
            elif err == errno.ECONNREFUSED:
                out[r] = REFUSED
            elif err in (errno.EINPROGRESS, errno.EAGAIN):
                sel.register(s, selectors.EVENT_WRITE, r)
        end = time.monotonic() + timeout_s
        while sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                s = key.fileobj  # type: ignore[assignment]
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                out[key.data] = UP if err == 0 else REFUSED if err == errno.ECONNREFUSED \
                    else UNKNOWN
                sel.unregister(s)
    finally:
        sel.close()
        for s in socks:
            s.close()
    return out


class Liveness:
    """Heartbeats out, peers' heartbeats in; ``dead`` only grows within an epoch.

    A peer is dead when its heartbeat is silent for ``peer_timeout_s``, or at once when
    its presence port refuses a connection (its process is gone). A peer's port is probed
    only when its heartbeat has not moved for two heartbeats (so a job at rest probes
    nothing), and to learn that another node's address is reachable at all: a refusal
    from an address of another node counts only once a port of that node at that address
    accepted a connection, and never when it is this rank's own loopback address (a
    firewall that rejects connections must not pass for a dead peer). The
    addresses are verified by ``verify`` (the coordinator calls it once every rank has
    published its port: after the restore vote) and then VERIFY_BATCH per check."""

    #: a peer's presence port is probed at most this often
    PROBE_EVERY_S = 0.25
    #: the longest one check waits for its probes' answers (the monitor thread must beat)
    PROBE_WAIT_S = 0.2
    #: an address that did not answer this many times is not tried again (its refusals unused)
    VERIFY_TRIES = 3
    #: addresses not yet known reachable, probed per check
    VERIFY_BATCH = 16
    #: addresses probed at once by ``verify``
    VERIFY_AT_ONCE = 256

    def __init__(self, kv: KV, rank: int, world: int, peer_timeout_s: float,
                 complete_steps: Callable[[], list[int]],
                 last_step: Callable[[], int | None], *, heartbeat_s: float = 0.5,
                 addr: str = "127.0.0.1", node: str | None = None) -> None:
        """``node``: what tells this rank's node from others (CUDASNAP_NODE_ID; default the
        host name): ranks of one node share its shared memory, and read each other's
        arenas."""
        self.kv = kv
        self.rank = rank
        self.world = world
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_s = heartbeat_s
        self._complete_steps = complete_steps
        self._last_step = last_step
        self.host = node or default_node_id()
        self._seq = 0
        self._seen: dict[int, tuple[str, float]] = {}
        self.peer_steps: dict[int, list[int]] = {}  # from the last heartbeat of each peer
        self._hosts: dict[int, str] = {rank: self.host}
        self._ports: dict[int, str] = {}  # peers' presence ports
        # (node, address) pairs where a port accepted a connection, and the verification
        # probes of a pair that got no answer
        self._verified: set[tuple[str | None, str]] = set()
        self._tries: dict[tuple[str | None, str], int] = {}
        self._probed: dict[int, float] = {}
        self.dead: set[int] = set()
        # Peers that closed cleanly: rank -> its final committed step (-1: it had none).
        self.closed: dict[int, int] = {}
        self.lock = threading.Lock()
        self._beat_lock = threading.Lock()  # a beat never overwrites the closed marker
        self._closing = False
        try:
            self.presence = Presence(addr)
        except OSError as e:
            raise ConfigError(f"peer liveness: cannot listen on {addr!r} ({e}); set "
                              "CUDASNAP_REPLICA_ADDR to an address of this host") from None
        kv.set(f"host/{rank}", self.host)
        kv.set(f"proc/{rank}", self.presence.addr)

    def beat(self) -> None:
        self.presence.drain()
        with self._beat_lock:
            if self._closing:
                return
            self._seq += 1
            steps = ",".join(str(s) for s in self._complete_steps())
            last = self._last_step()
            self.kv.set(f"hb/{self.rank}",
                        f"{self._seq}:{last if last is not None else -1}:{steps}")

    def close(self, step: int) -> None:
        """This rank ends cleanly, its final snapshot (``step``; -1: none) committed: the
        last heartbeat says so, and no later beat overwrites it."""
        with self._beat_lock:
            self._closing = True
            self.kv.set(f"hb/{self.rank}", f"{CLOSED}{step}")

    def stop(self) -> None:
        """The presence port closes (the process is about to end)."""
        self.presence.close()

    def host_of(self, rank: int) -> str | None:
        h = self._hosts.get(rank)
        if h is None:
            h = self.kv.get(f"host/{rank}")
            if h is not None:
                self._hosts[rank] = h
        return h

    def live_host_mate(self, rank: int, dead: set[int]) -> int | None:
        """The lowest rank on ``rank``'s host that is neither in ``dead`` nor dead now."""
        host = self.host_of(rank)
        mates = [r for r in range(self.world) if r != rank and r not in dead
                 and r not in self.dead and self.host_of(r) == host]
        return min(mates) if mates else None

    def check(self) -> list[int]:
        """Peers found dead by this call."""
        with self.lock:
            return self._check_locked()

    def _port(self, r: int) -> str | None:
        if r not in self._ports:
            v = self.kv.get(f"proc/{r}")
            if v is None:
                return None
            self._ports[r] = v
        return self._ports[r]

    def _address(self, r: int, port: str) -> tuple[str | None, str]:
        """The (node, address) of ``r``'s port: what a verification is about."""
        return self.host_of(r), port.rpartition(":")[0]

    def _trusted(self, r: int, port: str) -> bool:
        """Does a refusal from ``r``'s port mean its process is gone? Yes on this node; on
        another, once a port of that node at that address answered, unless the address is
        this rank's own loopback address (every node published ``127.0.0.1``: the probe
        reached this node, not that one)."""
        node, addr = self._address(r, port)
        if node == self.host:
            return True
        mine = self._address(self.rank, self.presence.addr)[1]
        if addr == mine and ipaddress.ip_address(addr.strip("[]")).is_loopback:
            return False
        return (node, addr) in self._verified

    def _unverified(self, ranks: list[int], now: float, limit: int) -> list[int]:
        """One rank of each address not yet known reachable, up to ``limit``."""
        out: dict[tuple[str | None, str], int] = {}
        for r in ranks:
            port = self._port(r)
            if port is None or r in self.dead or r in self.closed \
                    or now - self._probed.get(r, 0.0) < 2 * self.heartbeat_s:
                continue
            a = self._address(r, port)
            if a[0] != self.host and a not in self._verified and a not in out \
                    and self._tries.get(a, 0) < self.VERIFY_TRIES:
                out[a] = r
        return list(out.values())[:limit]

    def _to_probe(self, stale: list[int], now: float) -> dict[int, str]:
        """The stale peers' ports, and up to VERIFY_BATCH addresses not yet verified."""
        want = [r for r in stale if now - self._probed.get(r, 0.0) >= self.PROBE_EVERY_S]
        want += [r for r in self._unverified(sorted(self._seen), now, self.VERIFY_BATCH)
                 if r not in want]
        out = {}
        for r in want:
            port = self._port(r)
            if port is not None:
                out[r] = port
                self._probed[r] = now
        return out

    def _probe(self, ports: dict[int, str]) -> list[int]:
        """Probes ``ports``; the peers whose refusal is trusted (see the class docstring)."""
        gone = []
        for r, res in probe(ports, self.PROBE_WAIT_S).items():
            a = self._address(r, ports[r])
            if res == UP:
                self._verified.add(a)
            elif res == REFUSED and self._trusted(r, ports[r]):
                gone.append(r)
            elif a not in self._verified:
                self._tries[a] = self._tries.get(a, 0) + 1
                if self._tries[a] == self.VERIFY_TRIES:
                    log.info("rank %d: node %s at %s (peer rank %d's presence port, %s) did "
                             "not answer; failures there are noticed by the heartbeats' "
                             "silence only", self.rank, a[0], a[1], r, res)
        return gone

    def verify(self) -> None:
        """Learns which peers' addresses are reachable (every rank's port published)."""
        with self.lock:
            now = time.monotonic()
            peers = [r for r in range(self.world) if r != self.rank]
            pick = self._unverified(peers, now, self.VERIFY_AT_ONCE)
            ports = {r: p for r in pick if (p := self._port(r)) is not None}
            for r in ports:
                self._probed[r] = now
            if ports:
                self._probe(ports)

    def _gone(self, stale: list[int], now: float) -> list[int]:
        """Peers whose presence port refused a connection, where a refusal is trusted."""
        ports = self._to_probe(stale, now)
        return self._probe(ports) if ports else []

    def _check_locked(self) -> list[int]:
        now = time.monotonic()
        newly_dead = []
        silent: list[int] = []
        stale: list[int] = []
        for r in range(self.world):
            if r == self.rank or r in self.dead or r in self.closed:
                continue
            val = self.kv.get(f"hb/{r}")
            if self._closed_beat(r, val):
                continue
            if val is not None:
                prev = self._seen.get(r)
                if prev is None or prev[0] != val:
                    self._seen[r] = (val, now)
                    parts = val.split(":")
                    self.peer_steps[r] = [int(s) for s in parts[2].split(",") if s] \
                        if len(parts) > 2 else []
            seen = self._seen.get(r)
            if seen is None:
                continue  # never beat: still starting
            if now - seen[1] > self.peer_timeout_s:
                silent.append(r)
            elif now - seen[1] > 2 * self.heartbeat_s:
                stale.append(r)
        gone = self._gone(stale, now)
        for r in silent + gone:
            # It may have closed (and exited) since its heartbeat was read above.
            if self._closed_beat(r, self.kv.get(f"hb/{r}")):
                continue
            self.dead.add(r)
            newly_dead.append(r)
            log.error("rank %d: peer rank %d is %s", self.rank, r,
                      f"silent for more than {self.peer_timeout_s:.1f} s" if r in silent
                      else "gone (its presence port refused a connection)")
        return newly_dead

    def _closed_beat(self, r: int, val: str | None) -> bool:
        """True (and ``r`` counted as closed) when ``val``, its heartbeat, is the closed marker."""
        if val is None or not val.startswith(CLOSED):
            return False
        self.closed[r] = int(val[len(CLOSED):])
        log.info("rank %d: peer rank %d closed (final committed step %d)", self.rank, r,
                 self.closed[r])
        return True
