"""Lose a node, lose one step: node-loss replication measured end to end (issue 25).

Two "nodes" of one rank each on this host (tools/dist/node_launch.py: own node id, own
shared-memory directory under /dev/shm, own replica address, DDP on gloo), replication on
(CUDASNAP_NODE_REPLICA=1). Three runs of the same job, plus the raw transport:

  reference   no cudasnap, no failure: the final state every other run must equal bitwise
  peer        node 1's rank SIGKILLs itself in the forward of --kill-step once its replica of
              the previous step is acknowledged; every process of the job dies, node 1's
              shared memory is removed; a new node 1 (empty memory) and the old node 0
              start again: node 1's rank fetches its copy from node 0's memory
  disk        the same, every rank flushed at --kill-step - 1 and BOTH nodes' memory lost:
              the restore of the same step from disk (the fallback; the page cache of the
              snapshot files is dropped before the restart)
  raw tcp     the snapshot's bytes over one TCP connection between the two nodes'
              addresses (sendall -> recv_into a buffer), the transport replication uses
  guard       the health guard on (CUDASNAP_HEALTH=1, as torchrun jobs run): only node 1's
              processes die; node 0's exit on their own after a flush round that writes
              node 1's rank from the copy node 0 holds and commits the step
              (survivor_exit_s: the kill seen -> the last survivor out); then both nodes'
              memory is lost: the restore comes from that commit, bitwise
  both lost   node 1 lost and node 0's memory too, nothing flushed: the restart starts
              over with an ERROR naming the lost steps (never a silent step 0)
  renumbered  node 1 lost, then the restart gives each node the other's ranks; the job
              ends cleanly: arenas of the job left in either node's memory (leaked_arenas)
  parity      four nodes of one rank, node 1 lost: full copies against XOR parity
              (CUDASNAP_NODE_REPLICA=xor:4), memory per node and replication rate of each
              (parity_vs_copies)

Prints one JSON line: bitwise, replayed_steps (kill step - restored step), restore_source
(of the lost node's rank), replication throughput (bytes / seconds from the first header
byte to the acknowledgement: connect, meta, CRC table, data, the receiver's CRC check and
commit; median per transfer, measured in the job, beside training) against raw TCP of the
same bytes (sendall -> recv_into, no training beside it), and the replicator's own path alone
in the same conditions as the raw figure ("replication_idle"), host memory per node (own arena + guest copies,
allocated bytes of the files), recovery time (loss seen -> first resumed step of the lost
node's rank, which includes starting Python and importing torch) and the restore call alone,
from peer memory and from disk.

    python bench/node_loss.py --quick      # ~7 MB of state per rank, ~2 min on 2 cores
    python bench/node_loss.py              # ~50 MB of state per rank
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "dist"))

import node_launch  # noqa: E402

from bench._common import drop_cache  # noqa: E402


def raw_tcp_mb_s(nbytes: int, repeats: int = 5) -> float:
    """Median MB/s of ``nbytes`` over one loopback TCP connection (node 0 -> node 1)."""
    srv = socket.create_server(("127.0.0.11", 0))
    port = srv.getsockname()[1]
    payload = memoryview(bytes(nbytes))
    sink = bytearray(nbytes)

    def rx() -> None:
        for _ in range(repeats):
            conn, _ = srv.accept()
            with conn:
                mv, got = memoryview(sink), 0
                while got < nbytes:
                    k = conn.recv_into(mv[got:], min(nbytes - got, 4 << 20))
                    if k == 0:
                        break
                    got += k
                conn.sendall(b"k")

    t = threading.Thread(target=rx, daemon=True)
    t.start()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.11", port)) as c:
            c.sendall(payload)
            c.recv(1)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e6)
    t.join(30)
    srv.close()
    return statistics.median(rates)


def wire_mb_s(nbytes: int, shm: Path, repeats: int = 5) -> float:
    """Median MB/s of the replicator's own path alone (no training beside it), between the
    same addresses as raw_tcp_mb_s: a COMPLETE slot of ``nbytes`` sent by send_slot and
    landed by GuestStore.receive (checked, committed), a connection per transfer."""
    import ctypes
    import os
    import struct

    from cudasnap import _native
    from cudasnap.distributed.replica_store import GuestStore
    from cudasnap.distributed.replica_wire import configure, recv_msg, send_msg, send_slot, slot_header

    C = _native.native()
    chunk = 4 << 20
    shm.mkdir(parents=True, exist_ok=True)
    a = C.Arena.create(str(shm / "src.arena"), 2, nbytes + chunk, 1 << 16, chunk, "wire", True)
    slot = a.pick_write_slot()
    a.begin_write(slot, 1, b"{}")
    payload = os.urandom(nbytes)
    a.data_view(slot, nbytes)[:] = payload
    crcs = [C.crc32c(payload[i:i + chunk]) for i in range(0, nbytes, chunk)]
    table = struct.pack(f"<{len(crcs)}I", *crcs)
    ctypes.memmove(a.table_ptr(slot), table, len(table))
    a.commit(slot, 1, nbytes)
    (shm / "guests").mkdir()
    guests = GuestStore(shm / "guests", "wire")
    srv = socket.create_server(("127.0.0.11", 0))
    port = srv.getsockname()[1]

    def rx() -> None:
        for _ in range(repeats + 1):
            conn, _ = srv.accept()
            with conn:
                configure(conn, 60)
                guests.receive(conn, recv_msg(conn), 0)
                send_msg(conn, {"ok": True})

    t = threading.Thread(target=rx, daemon=True)
    t.start()
    rates = []
    for i in range(repeats + 1):  # the first one makes the guest arena
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.11", port)) as c:
            configure(c, 60)
            send_slot(c, a, slot, slot_header(a, slot))
            recv_msg(c)
        if i:
            rates.append(nbytes / (time.perf_counter() - t0) / 1e6)
    t.join(30)
    srv.close()
    return statistics.median(rates)


def bitwise(a: node_launch.NodeRun, b: node_launch.NodeRun, world: int) -> bool:
    for rank in range(world):
        x, y = a.state(rank), b.state(rank)
        if sorted(x) != sorted(y) or not all(np.array_equal(x[k], y[k]) for k in x):
            return False
    return True


def parity_vs_copies(base: Path, shm: Path, env: dict[str, str], steps: int, kill_step: int,
                     k: int = 4) -> dict:
    """The same job on k nodes of one rank, node 1 lost at ``kill_step``: full copies
    (CUDASNAP_NODE_REPLICA=1) against XOR parity (xor:k), run one after the other here.
    Memory per node: the allocated bytes of its shared-memory files at the end of the
    restarted run (own arena; guest copies or parity files), the nodes that were not lost;
    replication rate: bytes a rank sent / seconds sending (copies: per transfer, median;
    parity: all its segments, each from the first byte to the receiver's reply that it
    XORed it in); parity's ``round_mb_s``: the same bytes / whole rounds (from the step's
    agreement to every member's parity written: the store polls and the slowest member)."""
    ref = node_launch.reference(base / "xref", nodes=k, steps=steps, env=env)
    runs = {name: node_launch.run(base / name, nodes=k, steps=steps, kill_node=1,
                                  kill_step=kill_step, shm_root=shm / name, timeout=400,
                                  env={**env, "CUDASNAP_NODE_REPLICA": mode})
            for name, mode in (("copies", "1"), ("parity", f"xor:{k}"))}
    for name, r in (("xref", ref), *runs.items()):
        if not r.ok():
            print(r.logs(), file=sys.stderr)
            raise SystemExit(f"the {name} run ({k} nodes) failed: {r.rcs}")
    out: dict = {"nodes": k}
    for name, r in runs.items():
        rep = r.kill["replica"] if r.kill else {}
        mem = [r.ranks[n]["shm"] for n in range(k) if n != 1]
        own = statistics.median(m["own"] for m in mem)
        extra = statistics.median(m["guest"] + m.get("parity", 0) for m in mem)
        round_rate = None
        if name == "copies":
            rate, sent = rep.get("mb_per_s_median"), rep.get("bytes", 0) / max(1, rep.get("sent") or 1)
        else:
            secs, send = rep.get("parity_seconds") or 0.0, rep.get("parity_send_seconds") or 0.0
            rate = rep.get("parity_bytes", 0) / send / 1e6 if send else None
            round_rate = rep.get("parity_bytes", 0) / secs / 1e6 if secs else None
            sent = rep.get("parity_bytes", 0) / max(1, rep.get("parity_rounds") or 1)
        out[name] = {"bitwise": bitwise(r, ref, k),
                     "restore_source_lost": r.ranks[1]["restore"]["source"],
                     "resumed_at": r.ranks[1]["start"],
                     "memory_per_node_mb": {"own": round(own / 1e6, 1),
                                            "redundancy": round(extra / 1e6, 1),
                                            "total": round((own + extra) / 1e6, 1)},
                     "replication_mb_s": round(rate, 1) if rate else None,
                     "round_mb_s": round(round_rate, 1) if round_rate else None,
                     "bytes_sent_per_protected_step_mb": round(sent / 1e6, 2),
                     "protected_steps": rep.get("sent") if name == "copies"
                     else rep.get("parity_rounds")}
    c, p = out["copies"]["memory_per_node_mb"], out["parity"]["memory_per_node_mb"]
    out["redundancy_parity_vs_copies"] = round(p["redundancy"] / c["redundancy"], 3) \
        if c["redundancy"] else None
    out["total_parity_vs_copies"] = round(p["total"] / c["total"], 3) if c["total"] else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small state, ~2 min")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill-step", type=int, default=16)
    args = ap.parse_args()
    width, depth = (512, 2) if args.quick else (1024, 4)
    env = {"WIDTH": str(width), "DEPTH": str(depth), "STEP_SLEEP": "0.05"}
    base = Path(tempfile.mkdtemp(prefix="cudasnap-node-loss-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="cudasnap-node-loss-", dir="/dev/shm"))
    world = 2
    try:
        ref = node_launch.reference(base / "ref", steps=args.steps, env=env)
        peer = node_launch.run(base / "peer", steps=args.steps, kill_node=1,
                               kill_step=args.kill_step, env=env, shm_root=shm / "peer",
                               timeout=400)
        disk = node_launch.run(base / "disk", steps=args.steps, kill_node=1,
                               kill_step=args.kill_step, lose=(0, 1), shm_root=shm / "disk",
                               env={**env, "FLUSH_AT": str(args.kill_step - 1)}, timeout=400,
                               between=lambda r: [drop_cache(f) for f in r.ckpt.rglob("*")
                                                  if f.is_file()])
        guard = node_launch.run(base / "guard", steps=args.steps, kill_node=1,
                                kill_step=args.kill_step, lose=(0, 1), survivors="wait",
                                shm_root=shm / "guard", timeout=400,
                                env={**env, "CUDASNAP_HEALTH": "1"})
        both = node_launch.run(base / "both", steps=args.steps, kill_node=1,
                               kill_step=args.kill_step, lose=(0, 1), shm_root=shm / "both",
                               env=env, timeout=400)
        renum = node_launch.run(base / "renum", steps=args.steps, kill_node=1,
                                kill_step=args.kill_step, renumber=True,
                                shm_root=shm / "renum", env=env, timeout=400)
        parity = parity_vs_copies(base, shm, env, args.steps, args.kill_step)
        for name, r in (("reference", ref), ("peer", peer), ("disk", disk), ("guard", guard),
                        ("both", both), ("renumbered", renum)):
            if not r.ok():
                print(r.logs(), file=sys.stderr)
                raise SystemExit(f"the {name} run failed: {r.rcs}")
        lost, survivor = peer.ranks[1], peer.ranks[0]
        rep = peer.kill["replica"] if peer.kill else {}
        nbytes = int(rep["bytes"] / rep["sent"]) if rep.get("sent") else 0
        raw = raw_tcp_mb_s(nbytes) if nbytes else None
        wire = wire_mb_s(nbytes, shm / "wire") if nbytes else None
        repl = rep.get("mb_per_s_median")
        out = {
            "bench": "node_loss", "quick": args.quick, "state_bytes_per_rank": nbytes,
            "bitwise": bitwise(peer, ref, world) and bitwise(disk, ref, world),
            "bitwise_peer": bitwise(peer, ref, world), "bitwise_disk": bitwise(disk, ref, world),
            "replayed_steps": max(args.kill_step - (peer.ranks[r]["start"] - 1)
                                  for r in range(world)),
            "restore_source": lost["restore"]["source"],
            "restore_source_survivor": survivor["restore"]["source"],
            "replication_mb_s": round(repl, 1) if repl else None,  # median per transfer
            "replication_mb_s_all": round(rep["mb_per_s"], 1) if rep.get("mb_per_s") else None,
            "raw_tcp_mb_s": round(raw, 1) if raw else None,
            "replication_vs_raw": round(repl / raw, 3) if repl and raw else None,
            "replication_idle_mb_s": round(wire, 1) if wire else None,
            "replication_idle_vs_raw": round(wire / raw, 3) if wire and raw else None,
            "replicas_sent": rep.get("sent"), "replicas_skipped": rep.get("skipped"),
            "host_memory_per_node": {f"node{r}": peer.ranks[r]["shm"] for r in range(world)},
            "recovery_s_peer": round(lost["t_first_step"] - peer.t_lost, 2),
            "recovery_s_disk": round(disk.ranks[1]["t_first_step"] - disk.t_lost, 2),
            "restore_s_peer": round(lost["restore"]["seconds"], 3),
            "restore_s_disk": round(disk.ranks[1]["restore"]["seconds"], 3),
            "restore_source_disk_run": disk.ranks[1]["restore"]["source"],
            "survivor_exit_s": round(max(guard.survivor_exit.values()), 2)
            if guard.survivor_exit else None,
            "guard_run": {"bitwise": bitwise(guard, ref, world),
                          "restore_source": [guard.ranks[r]["restore"]["source"]
                                             for r in range(world)],
                          "resumed_at": [guard.ranks[r]["start"] for r in range(world)]},
            "both_copies_lost": {"resumed_at": [both.ranks[r]["start"] for r in range(world)],
                                 "error_logged": "starting over at step 0" in both.logs(),
                                 "bitwise": bitwise(both, ref, world)},
            "leaked_arenas": sum(len(v) for v in renum.leaked().values()),
            "bitwise_renumbered": bitwise(renum, ref, world),
            "parity": parity,
        }
        print(json.dumps(out))
        good = out["bitwise"] and out["replayed_steps"] <= 1 and out["guard_run"]["bitwise"] \
            and out["bitwise_renumbered"] and out["both_copies_lost"]["error_logged"] \
            and parity["parity"]["bitwise"] and parity["copies"]["bitwise"]
        return 0 if good else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
