"""Peer liveness: heartbeats in the store, and which peers are dead.

Every ``heartbeat_s`` the monitor publishes ``hb/<rank> = seq:last_step:complete_steps``
and reads the others'. A peer is dead when its heartbeat stops for
``peer_timeout_s`` (a SIGSTOPped or otherwise frozen process) or, for a peer
in this pid namespace of this boot, at once when its process is gone or a
zombie. A peer that never sent a heartbeat is not timed out (it may still be
starting).

A rank that ends cleanly (``close()`` with its final snapshot committed) replaces its
heartbeat by ``hb/<rank> = closed:<step>`` before it stops: its peers then count it as
closed, not dead. Its silence, and its process exiting, trigger nothing (the end of a
job is not a peer failure); a flush round does not wait for it (see flush_round).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .kv import KV

log = logging.getLogger("cudasnap.dist")

CLOSED = "closed:"  # prefix of the heartbeat of a rank that closed cleanly


def proc_ident() -> str:
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


def pid_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[:1]
    return bool(state) and state[0] in ("Z", "X")


class Liveness:
    """Heartbeats out, peers' heartbeats in; ``dead`` only grows within an epoch."""

    def __init__(self, kv: KV, rank: int, world: int, peer_timeout_s: float,
                 complete_steps: Callable[[], list[int]],
                 last_step: Callable[[], int | None]) -> None:
        self.kv = kv
        self.rank = rank
        self.world = world
        self.peer_timeout_s = peer_timeout_s
        self._complete_steps = complete_steps
        self._last_step = last_step
        self.host = socket.gethostname()
        self._ident = proc_ident()
        self._seq = 0
        self._seen: dict[int, tuple[str, float]] = {}
        self.peer_steps: dict[int, list[int]] = {}  # from the last heartbeat of each peer
        self._hosts: dict[int, str] = {rank: self.host}
        self._procs: dict[int, tuple[str, int]] = {}
        self.dead: set[int] = set()
        # Peers that closed cleanly: rank -> its final committed step (-1: it had none).
        self.closed: dict[int, int] = {}
        self.lock = threading.Lock()
        self._beat_lock = threading.Lock()  # a beat never overwrites the closed marker
        self._closing = False
        kv.set(f"host/{rank}", self.host)
        kv.set(f"proc/{rank}", f"{self._ident}:{os.getpid()}")

    def beat(self) -> None:
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

    def _proc_dead(self, r: int) -> bool:
        proc = self._procs.get(r)
        if proc is None:
            v = self.kv.get(f"proc/{r}")
            if v is None:
                return False
            ident, _, pid = v.rpartition(":")
            proc = self._procs[r] = (ident, int(pid))
        return proc[0] == self._ident and pid_gone(proc[1])

    def _check_locked(self) -> list[int]:
        now = time.monotonic()
        newly_dead = []
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
            silent = seen is not None and now - seen[1] > self.peer_timeout_s
            if silent or self._proc_dead(r):
                # It may have closed (and exited) since its heartbeat was read above.
                if self._closed_beat(r, self.kv.get(f"hb/{r}")):
                    continue
                self.dead.add(r)
                newly_dead.append(r)
                log.error("rank %d: peer rank %d is %s", self.rank, r,
                          f"silent for more than {self.peer_timeout_s:.1f} s" if silent
                          else "gone (its process exited)")
        return newly_dead

    def _closed_beat(self, r: int, val: str | None) -> bool:
        """True (and ``r`` counted as closed) when ``val``, its heartbeat, is the closed marker."""
        if val is None or not val.startswith(CLOSED):
            return False
        self.closed[r] = int(val[len(CLOSED):])
        log.info("rank %d: peer rank %d closed (final committed step %d)", self.rank, r,
                 self.closed[r])
        return True
