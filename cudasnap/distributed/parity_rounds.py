"""XOR parity rounds (``node_replica="xor:K"``): encoding in the background, rebuilding at restore.

The math, images and files are cudasnap.distributed.parity's; this module runs them for one rank
inside its Replicator (cudasnap.distributed.replica), which owns the sockets and the threads.

Call order (the Replicator's): ``ParityKeeper(replicator, k)`` -> ``run()`` on its sender
thread (rounds until the stop event) -> ``serve_put``/``serve_get`` on its server's request
threads -> ``rebuild()`` from the restore vote -> ``stop(clean)``.

A **round** ``n`` of parity set ``sid`` (store keys ``xor/<sid>/<n>/...``):

1. every member proposes the step of its newest COMPLETE slot (compare-and-set: the first
   proposal is the round's step W); a member whose arena does not hold W, and never will
   (it holds a newer step), aborts the round (``abort``), and a new one starts;
2. each member **leases** its slot of W and publishes its image's length and prefix CRC
   (``desc/<pos>``); ``seg`` follows from the longest image;
3. each member sends segment ``seg_index(p, q, K)`` of its image to the member at position
   p (``xput``); the receiver XORs it into a hidden file of its shared memory as the bytes
   arrive, and once all K-1 contributions are in, renames it to its parity file and says
   so (``got/<pos>``). A contribution cut half-way aborts the round;
4. once every member said ``got``, each member releases the lease of the previous round's
   slot and removes its previous parity file: until then the old round stays rebuildable
   (both leases held, both parity files kept), so a node lost at any moment of a round
   leaves one complete round (the Snapshotter keeps one more slot in this mode, so the two
   leases never stop its snapshots).
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._proc import pid_alive
from ..errors import SnapshotError
from .parity import (
    Accumulator,
    Image,
    Link,
    parity_files,
    parity_path,
    parity_sets,
    read_parity,
    read_trailer,
    seg_bytes,
    seg_index,
)
from .replica_store import find_slot
from .replica_wire import PIECE, Throttle, WireError, recv_into, recv_msg, send_msg

if TYPE_CHECKING:
    import socket

    from cudasnap._C import Arena


log = logging.getLogger("cudasnap.distributed")

_POLL_S = 0.02  # idle: a newer snapshot to encode
_ROUND_POLL_S = 0.01  # within a round: the peers' keys
_KEEP_ROUNDS = 4  # the store keys of the rounds before the last few are removed
_PIECE = min(PIECE, 4 << 20)


class _Abort(Exception):
    pass


def _send_range(sock: socket.socket, img: Image, off: int, n: int, stop: threading.Event,
                throttle: Throttle | None = None) -> None:
    """``n`` bytes of ``img`` from ``off``, in pieces, straight from the leased slot;
    ``throttle``: the background send (paced, and paused while a flush of this process
    writes, as a full copy's)."""
    C = native()
    o = 0
    while o < n:
        while throttle is not None and C.flush_active() > 0:
            if stop.wait(0.005):
                raise WireError("replication stopped")
        m = min(_PIECE, n - o)
        for v in img.pieces(off + o, m):
            sock.sendall(v)
        o += m
        if throttle is not None:
            throttle.pace(m, stop)
        if stop.is_set():
            raise WireError("replication stopped")


class ParityKeeper:
    """One rank's part in its parity set (see the module docstring for the call order)."""

    def __init__(self, rep: Link, k: int) -> None:
        self.rep, self.k = rep, k
        self.kv, self.rank, self.job, self.shm = rep.kv, rep.rank, rep.job, rep.shm
        self.members: list[int] | None = None
        self.sid = -1
        self._pinned: tuple[Arena, int, int] | None = None  # (arena, slot, step) of the last round
        self._tried = -1  # the step of the last round agreed (completed or aborted)
        self._accs: dict[tuple[int, int], Accumulator] = {}  # (sid, round) -> parity being made
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = {"parity_set": None, "parity_rounds": 0, "parity_step": None,
                                      "parity_aborts": 0, "parity_bytes": 0,
                                      "parity_seconds": 0.0, "parity_send_seconds": 0.0,
                                      "parity_file_bytes": 0}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    # ------------------------------------------------------------ rounds
    def _set(self) -> bool:
        nodes = self.rep.nodes(timeout=0.0)
        if nodes is None:
            return False
        try:
            sets = parity_sets(nodes, self.k)
        except ValueError as e:
            log.error("rank %d: XOR parity is off: %s", self.rank, e)
            sets = []
        mine = [s for s in sets if self.rank in s]
        if not mine:
            log.warning("rank %d: no parity set (every rank on node %s, or nodes of unequal "
                        "size): node-loss protection is off", self.rank, self.rep.node)
            self.members = []
            return True
        self.members = mine[0]
        self.sid = min(self.members)
        with self._lock:
            self._stats["parity_set"] = list(self.members)
        log.info("rank %d: XOR parity set %s (one rank per node, groups of %d nodes)",
                 self.rank, self.members, self.k)
        return True

    def run(self) -> None:
        """Rounds until the Replicator stops (its sender thread); the lease of the last
        round's slot is released when it ends."""
        try:
            self._rounds()
        finally:
            pinned, self._pinned = self._pinned, None
            if pinned is not None:
                pinned[0].release(pinned[1])

    def _rounds(self) -> None:
        stop = self.rep.stopping
        n, failed = 0, 0
        while not stop.wait(_POLL_S + min(2.0, 0.1 * failed)):
            if self.members is None and not self._set():
                continue
            if not self.members:
                return
            if self.rep.local.last_step() is None:
                continue  # until training runs: a restore (maybe a rebuild) has the cores
            try:
                ok = self._round(n)
            except _Abort:
                ok = False
            except Exception as e:  # noqa: BLE001 - the store, a peer, a bad header: next round
                if stop.is_set():
                    return
                failed += 1
                (log.error if failed % 10 == 0 else log.warning)(
                    "rank %d: parity round %d failed (%d in a row; node-loss protection stays "
                    "at step %s until a round completes): %s", self.rank, n, failed,
                    self._pinned[2] if self._pinned else None, e)
                self._abort(n, f"rank {self.rank}: {e}")
                ok = False
            if ok:
                failed = 0
            elif stop.is_set():
                return
            else:
                with self._lock:
                    self._stats["parity_aborts"] += 1
            self._drop_rounds(upto=n)
            self._forget(n - _KEEP_ROUNDS)
            n += 1

    def _abort(self, n: int, why: str) -> None:
        self._abort_round(self.sid, n, why)

    def _abort_round(self, sid: int, n: int, why: str) -> None:
        try:
            self.kv.set(f"xor/{sid}/{n}/abort", why[:500])
        except Exception as e:  # noqa: BLE001
            log.debug("rank %d: abort of parity round %d not published: %s", self.rank, n, e)

    def _forget(self, n: int) -> None:
        """The store keys of round ``n`` (this member's; position 0: the round's own): a
        long job must not grow the store. Members are at most two rounds apart (a round
        ends for all once each took part, or aborts), so ``_KEEP_ROUNDS`` back none reads them."""
        if n < 0 or not self.members:
            return
        key, pos = self._key(n), self.members.index(self.rank)
        try:
            for k in (f"{key}/desc/{pos}", f"{key}/got/{pos}") + \
                    ((f"{key}/step", f"{key}/abort") if pos == 0 else ()):
                self.kv.delete(k)
        except Exception as e:  # noqa: BLE001 - a store that cannot delete keeps them
            log.debug("rank %d: parity keys of round %d kept: %s", self.rank, n, e)

    def _key(self, n: int) -> str:
        return f"xor/{self.sid}/{n}"

    def _wait(self, n: int, cond: Any) -> Any:
        """Polls ``cond()`` until it returns something, the round aborts or we stop."""
        stop = self.rep.stopping
        while True:
            got = cond()
            if got is not None:
                return got
            if self.kv.get(f"{self._key(n)}/abort") is not None or stop.wait(_ROUND_POLL_S):
                raise _Abort

    def _newest(self) -> tuple[Arena, int, int] | None:
        arenas = self.rep.local.arenas()
        if not arenas:
            return None
        a = arenas[0]
        slot = a.newest_complete()
        return None if slot < 0 else (a, slot, int(a.slot_info(slot)["step"]))

    def _slot_of(self, n: int, step: int) -> tuple[Arena, int] | None:
        """This rank's slot of ``step``, leased; aborts the round when it will never have it."""
        newest = self._newest()
        if newest is None:
            return None
        a = newest[0]
        for i in range(a.num_slots):
            info = a.slot_info(i)
            if info["valid"] and int(info["step"]) == step:
                a.lease(i)
                info = a.slot_info(i)
                if info["valid"] and int(info["step"]) == step:
                    return a, i
                a.release(i)
        if newest[2] > step:
            self._abort(n, f"rank {self.rank} holds no slot of step {step}")
            raise _Abort
        return None

    def _round(self, n: int) -> bool:
        assert self.members is not None
        members, k, key = self.members, len(self.members), self._key(n)
        pos = members.index(self.rank)
        # a snapshot newer than the last round's, completed or aborted: a round that aborted
        # (a member skipped its step) is not proposed again at once, the store not churned
        last = max(self._pinned[2] if self._pinned is not None else -1, self._tried)
        while True:
            newest = self._newest()
            if newest is not None and newest[2] > last:
                break
            if self.rep.stopping.wait(_POLL_S):
                raise _Abort
        # the winner's nonce names the round in the files (``tag``): files of a round of
        # the same number in an earlier run of the job (an old store) never pass for it
        won = self.kv.propose(f"{key}/step", f"{newest[2]}:{secrets.token_hex(8)}")
        step, tag = int(won.split(":")[0]), f"{key}:{won}"
        self._tried = max(self._tried, step)
        arena, slot = self._wait(n, lambda: self._slot_of(n, step))
        ok = False
        try:
            t0 = time.perf_counter()
            img = Image(arena, slot)
            self.kv.set(f"{key}/desc/{pos}", json.dumps(img.desc()))
            descs = [json.loads(self._wait(n, lambda p=p: self.kv.get(f"{key}/desc/{p}")))
                     for p in range(k)]
            seg = seg_bytes([int(d["len"]) for d in descs], k)
            sent = 0
            try:
                for p in ((pos + i) % k for i in range(1, k)):  # rotated: one sender per holder
                    sent += self._put(members[p], n, step, seg, pos, img,
                                      seg_index(p, pos, k), descs[pos], tag)
            except (OSError, SnapshotError):
                # a holder sets got/ before its reply: a reply lost after every got/ is in
                # is a completed round, which the others may act on already
                if not all(self.kv.get(f"{key}/got/{p}") for p in range(k)):
                    raise
            for p in range(k):
                self._wait(n, lambda p=p: self.kv.get(f"{key}/got/{p}"))
            ok = True
        finally:
            if not ok:
                arena.release(slot)
        old, self._pinned = self._pinned, (arena, slot, step)
        if old is not None:
            old[0].release(old[1])
        for path, sid, holder, s in parity_files(self.shm, self.job):
            if sid == self.sid and holder == self.rank and s < step:
                path.unlink(missing_ok=True)
        with self._lock:
            st = self._stats
            st["parity_rounds"] += 1
            st["parity_step"] = step
            st["parity_bytes"] += sent
            st["parity_seconds"] += time.perf_counter() - t0
            st["parity_file_bytes"] = seg
        log.debug("rank %d: parity round %d of set %s: step %d, %d bytes sent", self.rank, n,
                  members, step, sent)
        return True

    def _put(self, to: int, n: int, step: int, seg: int, pos: int, img: Image, s: int,
             desc: dict[str, int], tag: str) -> int:
        sock, token = self.rep.connect(to)
        with sock:
            send_msg(sock, {"op": "xput", "token": token, "job": self.job, "src": self.rank,
                            "sid": self.sid, "round": n, "step": step, "seg": seg,
                            "members": self.members, "pos": pos, "desc": desc,
                            "tag": tag})
            t0 = time.perf_counter()
            _send_range(sock, img, s * seg, seg, self.rep.stopping, Throttle(self.rep.rate))
            reply = recv_msg(sock)
            with self._lock:
                self._stats["parity_send_seconds"] += time.perf_counter() - t0
        if not reply.get("ok"):
            raise WireError(f"rank {to} refused the parity segment: {reply.get('error')}")
        return seg

    def _drop_rounds(self, upto: int) -> None:
        """Parity files being made for rounds up to ``upto`` that will never finish."""
        with self._lock:  # serve_put writes under it: a dropped one is never written again
            for kk in [kk for kk in self._accs if kk[1] <= upto]:
                self._accs.pop(kk).drop()

    # ------------------------------------------------------------ server side
    def serve_put(self, conn: socket.socket, hdr: dict[str, Any]) -> None:
        sid, n, step, seg = (int(hdr[f]) for f in ("sid", "round", "step", "seg"))
        members = [int(m) for m in hdr["members"]]
        pos, src, tag = int(hdr["pos"]), int(hdr["src"]), str(hdr["tag"])
        if self.rank not in members or members[pos] != src or src == self.rank \
                or not 0 < seg <= 1 << 40:
            raise WireError(f"parity segment from rank {src} does not fit set {members}")
        key = (sid, n)
        with self._lock:
            acc = self._accs.get(key)
            if acc is None:
                acc = Accumulator(parity_path(self.shm, self.job, sid, self.rank, step), seg)
                acc.round = (tag, step, members)
                self._accs[key] = acc
            if acc.seg != seg or src in acc.got or acc.round != (tag, step, members):
                raise WireError(f"parity segment from rank {src} for round {n}: twice, or of "
                                "another size, step or set than the others")
            acc.got[src] = {}  # taken: a second one is refused
        buf = bytearray(min(_PIECE, seg))
        try:
            off = 0
            while off < seg:
                m = min(len(buf), seg - off)
                mv = memoryview(buf)[:m]
                recv_into(conn, mv)
                with self._lock:
                    if acc.dead:
                        raise WireError(f"parity round {n} of set {members} ended without it")
                    acc.add(off, mv)
                off += m
        except BaseException:
            self._abort_round(sid, n, f"rank {self.rank}: a segment of rank {src} was cut")
            raise
        with self._lock:
            acc.got[src] = {k: int(v) for k, v in dict(hdr["desc"]).items()}
            done = len(acc.got) == len(members) - 1 and all(acc.got.values())
            if done:
                self._accs.pop(key, None)
        if done:
            import os

            acc.finish({"sid": sid, "step": step, "seg": seg, "members": members,
                        "holder": self.rank, "pid": os.getpid(), "tag": tag,
                        "images": {str(k): v for k, v in acc.got.items()}})
            self.kv.set(f"xor/{sid}/{n}/got/{members.index(self.rank)}", "1")
        send_msg(conn, {"ok": True})

    def serve_get(self, conn: socket.socket, hdr: dict[str, Any]) -> None:
        """``what="parity"``: a parity file this node holds; ``"image"``: ``n`` bytes from
        ``off`` of the image of a slot this node holds (own arena or a renumbered one's)."""
        step = int(hdr["step"])
        if hdr.get("what") == "parity":
            path = parity_path(self.shm, self.job, int(hdr["sid"]), int(hdr["holder"]), step)
            t = read_trailer(path)
            data = read_parity(path, int(t["seg"]))
            send_msg(conn, {"ok": True, "n": len(data)})
            conn.sendall(data)
            return
        src, off, n = int(hdr["src"]), int(hdr["off"]), int(hdr["n"])
        if off < 0 or not 0 <= n <= 1 << 40:
            raise WireError(f"bad image range {off}+{n}")
        found = find_slot(self.shm, self.job, src, step)
        if found is None:
            raise WireError(f"no slot of rank {src} step {step} on node {self.rep.node}")
        a, i = found
        a.lease(i)
        try:
            if not a.slot_info(i)["valid"] or int(a.slot_info(i)["step"]) != step:
                raise WireError(f"rank {src}'s slot of step {step} changed while served")
            img = Image(a, i)
            send_msg(conn, {"ok": True, "n": n, "desc": img.desc()})
            _send_range(conn, img, off, n, self.rep.stopping)
        finally:
            a.release(i)

    # ------------------------------------------------------------ restore side
    def rebuild(self, plan: dict[str, Any], threads: int) -> tuple[Arena, int, Path]:
        """This rank's image of ``plan["step"]`` rebuilt from its set's survivors, landed in
        a temporary arena (cudasnap.distributed.parity_rebuild): (arena, slot, path)."""
        from .parity_rebuild import rebuild_rank

        return rebuild_rank(self.rep, self.rank, plan, threads)

    def stop(self, clean: bool) -> list[Path]:
        """Releases the lease; ``clean``: removes the parity files this process made, and
        those whose maker is gone (an earlier rank numbering's)."""
        self._drop_rounds(upto=1 << 62)  # (the lease: released as run() ends)
        gone: list[Path] = []
        if clean:
            import os

            for path, _sid, _holder, _step in parity_files(self.shm, self.job):
                try:
                    pid = int(read_trailer(path).get("pid", -1))
                except SnapshotError:
                    continue
                if pid == os.getpid() or not pid_alive(pid):
                    path.unlink(missing_ok=True)
                    gone.append(path)
        return gone
