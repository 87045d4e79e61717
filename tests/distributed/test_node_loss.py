"""Node loss (issue 25): a rank's snapshot also lives in a partner node's shared memory.

Unit tests of the wire and the guest arenas (a cut transfer is never visible, a damaged
chunk is refused on arrival, the partner is on another node), then whole jobs of two
"nodes" on this host (tools/dist/node_launch.py): a node lost -> its rank resumes from the
copy in the other node's memory, bitwise equal to a run without failure; its partner lost
too -> disk, said in the log; a node lost in the middle of a transfer -> the previous
replica.
"""
from __future__ import annotations

import ctypes
import dataclasses
import socket
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cudasnap import _native
from cudasnap.distributed.replica import ring_partner
from cudasnap.distributed.replica_store import GuestStore, guest_path, held_steps
from cudasnap.distributed.replica_wire import WireError, land, recv_msg, send_msg, send_slot, slot_header
from cudasnap.errors import CorruptSnapshot
from cudasnap.storage.listing import read_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dist"))
import node_launch  # noqa: E402
from replica_fakes import KV as _KV  # noqa: E402
from replica_fakes import Local as _Local  # noqa: E402
from replica_fakes import wait as _wait  # noqa: E402

CHUNK = 64 << 10


def _source(tmp_path: Path, step: int, payload: bytes, name: str = "src") -> tuple:
    C = _native.native()
    a = C.Arena.create(str(tmp_path / f"{name}.arena"), 2, 1 << 20, 4096, CHUNK, "job", False)
    slot = a.pick_write_slot()
    a.begin_write(slot, step, b'{"step": %d}' % step)
    a.data_view(slot, len(payload))[:] = payload
    crcs = [C.crc32c(payload[i:i + CHUNK]) for i in range(0, len(payload), CHUNK)]
    tbl = struct.pack(f"<{len(crcs)}I", *crcs)
    ctypes.memmove(a.table_ptr(slot), tbl, len(tbl))
    a.commit(slot, step, len(payload))
    return a, slot


def _transfer(src_arena, slot, receive, cut_at: int | None = None, corrupt: bool = False):
    """Sends the slot through a socketpair to ``receive(sock, hdr)`` on a thread."""
    a, b = socket.socketpair()
    hdr = slot_header(src_arena, slot)
    result: dict = {}

    def rx():
        try:
            result["value"] = receive(b, recv_msg(b))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e
        finally:
            b.close()

    t = threading.Thread(target=rx)
    t.start()
    if cut_at is None and not corrupt:
        try:
            send_slot(a, src_arena, slot, hdr)
        except BrokenPipeError:  # the receiver refused it and closed
            pass
    else:  # by hand: a cut stream, or a flipped data byte after the table
        send_msg(a, hdr)
        a.sendall(src_arena.read_meta(slot))
        tbl = src_arena.read_table(slot)
        a.sendall(struct.pack(f"<{len(tbl)}I", *tbl))
        data = bytearray(src_arena.data_view(slot, hdr["data_bytes"]))
        if corrupt:
            data[len(data) // 2] ^= 0xFF
        a.sendall(bytes(data[:cut_at]) if cut_at is not None else bytes(data))
    a.close()
    t.join(30)
    return result


def test_ring_partner_is_on_another_node():
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert [ring_partner(nodes, r) for r in range(4)] == [2, 3, 0, 1]
    assert ring_partner({0: "a", 1: "b", 2: "c"}, 2) == 0
    assert ring_partner({0: "a", 1: "a"}, 0) is None  # one node: nothing to copy to
    uneven = {0: "a", 1: "a", 2: "a", 3: "b"}
    assert {ring_partner(uneven, r) for r in (0, 1, 2)} == {3}


@pytest.mark.slow  # ~2 s: loads the extension (torch) first
def test_replica_lands_checked_and_a_cut_transfer_keeps_the_previous(tmp_path):
    payload = bytes(range(256)) * 1000  # 256 kB: 4 chunks
    src, slot = _source(tmp_path, 7, payload)
    shm = tmp_path / "shm"
    shm.mkdir()
    guests = GuestStore(shm, "job")
    got = _transfer(src, slot, lambda s, h: guests.receive(s, h, 3))
    assert got.get("value") == 7, got
    assert held_steps(shm, "job", None) == {3: [7]}
    assert oct(guest_path(shm, "job", 3).stat().st_mode & 0o777) == "0o600"
    src2, slot2 = _source(tmp_path, 8, payload[::-1], "src2")
    cut = _transfer(src2, slot2, lambda s, h: guests.receive(s, h, 3), cut_at=100_000)
    assert isinstance(cut.get("error"), WireError), cut
    assert held_steps(shm, "job", None) == {3: [7]}  # the torn one is invisible
    bad = _transfer(src2, slot2, lambda s, h: guests.receive(s, h, 3), corrupt=True)
    assert isinstance(bad.get("error"), CorruptSnapshot), bad
    assert held_steps(shm, "job", None) == {3: [7]}
    ok = _transfer(src2, slot2, lambda s, h: guests.receive(s, h, 3))
    assert ok.get("value") == 8 and held_steps(shm, "job", None) == {3: [8, 7]}
    from cudasnap.distributed.replica_store import claim_guests

    assert claim_guests(shm, "job") == 1  # a restarted holder keeps them from `cudasnap gc`
    C = _native.native()
    g = C.Arena.open(str(guest_path(shm, "job", 3)), False, False)
    i = next(i for i in range(2) if g.slot_info(i)["valid"] and g.slot_info(i)["step"] == 8)
    assert bytes(g.data_view(i, len(payload))) == payload[::-1]
    assert g.read_table(i) == src2.read_table(slot2)


def _arena_with_steps(path: Path, steps: tuple[int, ...]):
    C = _native.native()
    a = C.Arena.create(str(path), len(steps), 1 << 16, 4096, 4096, "job", False)
    for step in steps:
        slot = a.pick_write_slot()
        a.begin_write(slot, step, b"{}")
        a.commit(slot, step, 0)
    return a


def test_copies_newer_than_the_restored_step_are_emptied(tmp_path):
    # After a restore to step 5, a guest's step 6 and a leftover own arena's step 7 are of
    # the timeline before it: a later round must not take them for the re-run's steps.
    from cudasnap.distributed.replica_store import drop_newer

    _arena_with_steps(tmp_path / "cudasnap-job-g1.arena", (5, 6))
    _arena_with_steps(tmp_path / "cudasnap-job-r2.arena", (4, 7))
    mine = tmp_path / "cudasnap-job-r0.arena"
    _arena_with_steps(mine, (5, 6))
    assert drop_newer(tmp_path, "job", 5, {mine}) == 2
    assert held_steps(tmp_path, "job", None) == {0: [6, 5], 1: [5], 2: [4]}


def test_land_refuses_a_snapshot_that_does_not_fit(tmp_path):
    payload = b"x" * (300 << 10)
    src, slot = _source(tmp_path, 1, payload)
    C = _native.native()
    small = C.Arena.create(str(tmp_path / "small.arena"), 2, 128 << 10, 4096, CHUNK, "job", False)
    got = _transfer(src, slot, lambda s, h: land(s, h, small))
    assert "does not fit" in str(got.get("error"))


# ------------------------------------------------------------------ whole jobs
STEPS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    r = node_launch.reference(tmp_path_factory.mktemp("ref"), steps=STEPS)
    assert r.ok(), r.logs()
    return r


def _same(a: node_launch.NodeRun, b: node_launch.NodeRun, world: int = 2) -> None:
    for rank in range(world):
        x, y = a.state(rank), b.state(rank)
        assert sorted(x) == sorted(y)
        for k in x:
            assert np.array_equal(x[k], y[k]), (rank, k)


@pytest.mark.slow
def test_node_lost_resumes_from_peer_memory_bitwise(tmp_path, reference):
    r = node_launch.run(tmp_path, steps=STEPS, kill_node=1, kill_step=10, timeout=180)
    assert r.ok(), r.logs()
    assert r.kill is not None and r.kill["replica"]["sent_step"] >= 9
    lost, survivor = r.ranks[1], r.ranks[0]
    assert lost["restore"]["source"] == "peer-memory:0", r.logs()
    assert survivor["restore"]["source"] == "shm"
    assert lost["start"] == survivor["start"] == 10  # step 9 restored: 1 step replayed
    _same(r, reference)


@pytest.mark.slow
def test_partner_lost_too_falls_back_to_disk(tmp_path, reference):
    r = node_launch.run(tmp_path, steps=STEPS, kill_node=1, kill_step=10, lose=(0, 1),
                        env={"FLUSH_AT": "6"}, timeout=180)
    assert r.ok(), r.logs()
    assert {r.ranks[k]["restore"]["source"] for k in (0, 1)} == {"disk"}
    assert r.ranks[1]["start"] == 7
    assert "no node holds a copy of its snapshot in memory" in r.logs()
    _same(r, reference)


@pytest.mark.slow
def test_node_lost_during_replication_uses_the_previous_replica(tmp_path, reference):
    # ~30 kB of state at 0.1 MB/s in 5 kB pieces: each transfer takes ~0.3 s, a step 0.8 s;
    # the victim dies 0.15 s into the transfer of step 9 (an older replica complete).
    r = node_launch.run(tmp_path, steps=STEPS, kill_node=1, kill_step=10, kill_when="inflight",
                        env={"CUDASNAP_REPLICA_MAX_MBPS": "0.1", "STEP_SLEEP": "0.8"},
                        timeout=240)
    assert r.ok() and r.kill is not None, r.logs()
    rep = r.kill["replica"]
    assert rep["in_flight_step"] == 9 and 7 <= rep["sent_step"] <= 8, rep
    assert r.ranks[1]["restore"]["source"] == "peer-memory:0", r.logs()
    assert r.ranks[1]["start"] == r.ranks[0]["start"] == rep["sent_step"] + 1
    _same(r, reference)


@pytest.mark.slow
def test_fsdp2_two_nodes_of_two_ranks_resume_from_peer_memory_bitwise(tmp_path):
    # FSDP2 on a 4-rank mesh: no shard has a copy on its own node; node 1 (ranks 2, 3) lost.
    env = {"MODE": "fsdp"}
    ref = node_launch.reference(tmp_path / "ref", nodes=2, per_node=2, steps=12, env=env)
    assert ref.ok(), ref.logs()
    r = node_launch.run(tmp_path / "run", nodes=2, per_node=2, steps=12, kill_node=1,
                        kill_step=8, env=env, timeout=240)
    assert r.ok(), r.logs()
    assert [r.ranks[k]["start"] for k in range(4)] == [8] * 4  # step 7: 1 step replayed
    assert [r.ranks[k]["restore"]["source"] for k in (0, 1)] == ["shm", "shm"]
    assert all(r.ranks[k]["restore"]["source"].startswith("peer-memory:") for k in (2, 3))
    _same(r, ref, world=4)


@pytest.mark.slow
def test_survivors_commit_the_lost_nodes_step_then_a_second_loss_restores_it_from_disk(
        tmp_path):
    # FSDP2 on 2 nodes of 2 ranks, the health guard on. Node 1 lost at step 8: the
    # survivors (node 0) exit on their own after a flush round that writes ranks 2 and 3
    # from the guest copies node 0 holds and commits step 7 with every rank present. Then
    # node 0's memory is lost too: attempt 1 restores step 7 from disk, bitwise.
    env = {"MODE": "fsdp"}
    ref = node_launch.reference(tmp_path / "ref", nodes=2, per_node=2, steps=12, env=env)
    assert ref.ok(), ref.logs()
    # A 60 s peer timeout: only the dead ranks' presence ports can end the round in time.
    r = node_launch.run(tmp_path / "run", nodes=2, per_node=2, steps=12, kill_node=1,
                        kill_step=8, lose=(0, 1), survivors="wait", timeout=240,
                        env=dict(env, CUDASNAP_HEALTH="1", CUDASNAP_PEER_TIMEOUT_S="60"))
    assert r.ok(), r.logs()
    assert sorted(r.survivor_exit) == [0, 1] and max(r.survivor_exit.values()) < 30, \
        (r.survivor_exit, r.logs())
    step_dir = r.ckpt / "step-00000007"
    commit = read_commit(step_dir)
    assert commit["present"] == [0, 1, 2, 3] and commit["dead"] == [2, 3], commit
    assert "wrote dead rank 2's step 7 from the copy its node holds" in r.logs()
    assert [r.ranks[k]["restore"]["source"] for k in range(4)] == ["disk"] * 4, r.logs()
    assert [r.ranks[k]["start"] for k in range(4)] == [8] * 4
    _same(r, ref, world=4)
    assert not [d for d in r.ckpt.iterdir() if d.name.startswith("step-")
                and not (d / "COMMIT").exists()], "an uncommitted step directory was left"


@pytest.mark.slow
def test_both_copies_lost_with_nothing_on_disk_is_an_error_not_a_silent_step_0(tmp_path):
    # Steps of 0.15 s: the job runs for a while before the loss (its progress is logged
    # from the first boundary the peer monitor sees, then every 5 s).
    r = node_launch.run(tmp_path, steps=STEPS, kill_node=1, kill_step=10, lose=(0, 1),
                        timeout=180, env={"STEP_SLEEP": "0.15"})
    assert r.ok(), r.logs()
    assert [r.ranks[k]["start"] for k in (0, 1)] == [0, 0]
    logs = r.logs()
    # Nothing on disk, both memories gone: the coordinators' progress events still tell.
    assert "starting over at step 0" in logs and "records ranks that trained to step" in logs, \
        logs


def test_leftovers_of_dead_processes_and_fresh_guests_are_removed(tmp_path):
    from cudasnap.distributed.replica_store import clean_leftovers

    dead = 2 ** 22 + 12345  # above pid_max's default: never a live process
    names = [f".cudasnap-job-fetch-r1-{dead}.arena", f".cudasnap-job-g1.arena.tmp-{dead}",
             f".cudasnap-job-fetch-r1-{__import__('os').getpid()}.arena",
             "cudasnap-job-g1.arena", "cudasnap-job-r1.arena", "cudasnap-other-g1.arena"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert sorted(p.name for p in clean_leftovers(tmp_path, "job")) == sorted(names[:2])
    assert [p.name for p in clean_leftovers(tmp_path, "job", guests=True)] == [names[3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[2], *names[4:]])


@pytest.mark.slow
def test_replicators_send_to_the_other_node_and_serve_the_copy_back(tmp_path):
    from cudasnap.config import Settings
    from cudasnap.distributed.replica import Replicator

    shm0, shm1 = tmp_path / "n0", tmp_path / "n1"
    shm0.mkdir()
    shm1.mkdir()
    payload = bytes(range(251)) * 700
    src, slot = _source(shm0, 5, payload, "cudasnap-job-r0")
    kv = _KV()
    r0 = Replicator(kv, _Local(0, shm0, src), Settings(node_id="a", replica_addr="127.0.0.1"))
    r1 = Replicator(kv, _Local(1, shm1), Settings(node_id="b", replica_addr="127.0.0.1"))
    try:
        _wait(lambda: r0.stats()["sent_step"] == 5)
        assert r0.stats()["partner"] == 1 and r1.stats()["received"] == 1
        assert held_steps(shm1, "job", None) == {0: [5]}
        a, i, path = r1.fetch(1, 0, 5)  # rank 0's node was replaced: its copy comes back
        try:
            assert bytes(a.data_view(i, len(payload))) == payload
            assert a.read_table(i) == src.read_table(slot) and oct(path.stat().st_mode)[-3:] == "600"
        finally:
            path.unlink()
        with pytest.raises(WireError, match="no copy"):
            r0.fetch(1, 0, 6)
    finally:
        r0.stop()
        r1.stop(clean=True)
    assert held_steps(shm1, "job", None) == {}  # a clean end removes the guests


def test_a_replica_address_that_is_not_here_is_a_config_error(tmp_path):
    from cudasnap.config import Settings
    from cudasnap.distributed.replica import Replicator
    from cudasnap.errors import ConfigError

    with pytest.raises(ConfigError, match="CUDASNAP_REPLICA_ADDR"):
        Replicator(_KV(), _Local(0, tmp_path), Settings(replica_addr="203.0.113.7"))


def _write(a, step: int, payload: bytes) -> int:
    """One more COMPLETE snapshot in ``a`` (as the copy engine would write it)."""
    C = _native.native()
    slot = a.pick_write_slot()
    a.begin_write(slot, step, b'{"step": %d}' % step)
    a.data_view(slot, len(payload))[:] = payload
    crcs = [C.crc32c(payload[i:i + CHUNK]) for i in range(0, len(payload), CHUNK)]
    tbl = struct.pack(f"<{len(crcs)}I", *crcs)
    ctypes.memmove(a.table_ptr(slot), tbl, len(tbl))
    a.commit(slot, step, len(payload))
    return slot


@pytest.mark.slow
def test_snapshots_completed_during_a_transfer_are_skipped_and_counted(tmp_path):
    from cudasnap.config import Settings
    from cudasnap.distributed.replica import Replicator

    shm0, shm1 = tmp_path / "n0", tmp_path / "n1"
    shm0.mkdir()
    shm1.mkdir()
    C = _native.native()
    src = C.Arena.create(str(shm0 / "cudasnap-job-r0.arena"), 3, 1 << 20, 4096, CHUNK, "job",
                         False)
    payload = bytes(range(256)) * 800  # 200 kB at 0.4 MB/s: a transfer takes ~0.5 s
    _write(src, 1, payload)
    kv = _KV()
    cfg = Settings(replica_addr="127.0.0.1", replica_max_mbps=0.4)
    r0 = Replicator(kv, _Local(0, shm0, src), dataclasses.replace(cfg, node_id="a"))
    r1 = Replicator(kv, _Local(1, shm1), dataclasses.replace(cfg, node_id="b"))
    try:
        _wait(lambda: r0.stats()["in_flight_step"] == 1)
        _write(src, 2, payload)  # both complete while step 1 is on the wire
        _write(src, 3, payload)
        _wait(lambda: r0.stats()["sent_step"] == 3)
        s = r0.stats()
        assert (s["sent"], s["skipped"]) == (2, 1), s  # step 2 never sent
        assert held_steps(shm1, "job", None) == {0: [3, 1]}
    finally:
        r0.stop()
        r1.stop()


@pytest.mark.slow
def test_ranks_renumbered_by_the_restart_find_their_copies_on_either_node(tmp_path, reference):
    # attempt 1: the surviving node 0 runs rank 1 (its copy is node 0's guest: no transfer)
    # and the new node 1 runs rank 0 (fetched from node 0, where rank 0's own arena is)
    r = node_launch.run(tmp_path, steps=STEPS, kill_node=1, kill_step=10, renumber=True,
                        timeout=180)
    assert r.ok(), r.logs()
    assert r.ranks[1]["restore"]["source"] == "peer-memory:local", r.logs()
    assert r.ranks[0]["restore"]["source"].startswith("peer-memory:"), r.logs()
    assert r.ranks[0]["start"] == r.ranks[1]["start"] == 10
    _same(r, reference)
