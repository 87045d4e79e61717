"""XOR parity across nodes (issue 35 item 6, ``node_replica="xor:K"``).

The math on real arenas (every member of sets of 2..4 rebuilt bitwise from the others,
images of different lengths; a damaged parity byte refused), the sets and the rebuild
plans, live ParityKeepers of three "nodes" in one process (rounds agree on one step, the
encoded slot stays leased until the next round completed, older parity files go), and
whole jobs: three nodes of one rank and of two ranks, a node lost, its ranks rebuilt from
the survivors' parity and slots, bitwise equal to a run without failure.
"""
from __future__ import annotations

import ctypes
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cudasnap import _native
from cudasnap.config import Settings, node_replica_mode
from cudasnap.distributed.parity import (
    Accumulator,
    Image,
    land_image,
    parity_files,
    parity_path,
    parity_sets,
    plans,
    read_parity,
    read_trailer,
    rebuild,
    seg_bytes,
    seg_index,
)
from cudasnap.errors import ConfigError, CorruptSnapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dist"))
import node_launch  # noqa: E402
from replica_fakes import KV as _KV  # noqa: E402
from replica_fakes import Local  # noqa: E402
from replica_fakes import wait as _wait  # noqa: E402

CHUNK = 4096


def _arena(path: Path, step: int, payload: bytes, slots: int = 2):
    C = _native.native()
    a = C.Arena.create(str(path), slots, 1 << 20, 4096, CHUNK, "job", False)
    _write(a, step, payload)
    return a


def _write(a, step: int, payload: bytes) -> int:
    C = _native.native()
    slot = a.pick_write_slot()
    a.begin_write(slot, step, json.dumps({"step": step, "rank": 0, "world_size": 1}).encode())
    if payload:
        a.data_view(slot, len(payload))[:] = payload
    crcs = [C.crc32c(payload[i:i + CHUNK]) for i in range(0, len(payload), CHUNK)]
    tbl = struct.pack(f"<{len(crcs)}I", *crcs)
    if crcs:
        ctypes.memmove(a.table_ptr(slot), tbl, len(tbl))
    a.commit(slot, step, len(payload))
    return slot


def _encode(tmp: Path, members: list[int], images: dict[int, Image], step: int) -> int:
    """What the rounds do, in one thread: every member's parity file."""
    k = len(members)
    seg = seg_bytes([images[m].length for m in members], k)
    for p, h in enumerate(members):
        acc = Accumulator(parity_path(tmp, "job", members[0], h, step), seg)
        for q, m in enumerate(members):
            if m != h:
                acc.add(0, images[m].read(seg_index(p, q, k) * seg, seg))
                acc.got[m] = images[m].desc()
        acc.finish({"sid": members[0], "step": step, "seg": seg, "members": members, "tag": "t",
                    "holder": h, "pid": 1, "images": {str(m): d for m, d in acc.got.items()}})
    return seg


@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_member_is_rebuilt_bitwise_from_the_others(tmp_path, k):
    rng = np.random.default_rng(k)
    members = [10 * i + 3 for i in range(k)]
    payloads = {m: rng.integers(0, 256, 5000 + 3001 * i, dtype=np.uint8).tobytes()
                for i, m in enumerate(members)}
    arenas = {m: _arena(tmp_path / f"r{m}.arena", 7, payloads[m]) for m in members}
    images = {m: Image(a, a.newest_complete()) for m, a in arenas.items()}
    seg = _encode(tmp_path, members, images, 7)
    files = parity_files(tmp_path, "job")
    assert len(files) == k and all(oct(p.stat().st_mode)[-3:] == "600" for p, *_ in files)
    assert all(p.stat().st_size < seg + 4096 for p, *_ in files)  # 1/(k-1) of an image
    for lost in members:
        def parity_of(m: int) -> bytes:
            return read_parity(parity_path(tmp_path, "job", members[0], m, 7), seg)

        def segment_of(m: int, s: int) -> bytes:
            assert m != lost  # the lost member's bytes are never read
            return images[m].read(s * seg, seg)

        t = read_trailer(parity_path(tmp_path, "job", members[0],
                                     next(m for m in members if m != lost), 7))
        desc = t["images"][str(lost)]
        image = rebuild(lost, members, seg, desc["len"], parity_of, segment_of)
        a, i, path = land_image(image, desc, tmp_path, "job", lost, 2)
        try:
            assert bytes(a.data_view(i, len(payloads[lost]))) == payloads[lost]
            src = arenas[lost]
            j = src.newest_complete()
            assert a.read_table(i) == src.read_table(j) and a.read_meta(i) == src.read_meta(j)
            assert int(a.slot_info(i)["step"]) == 7
        finally:
            path.unlink()


def test_a_damaged_parity_byte_is_refused_not_restored(tmp_path):
    members = [0, 1, 2]
    payloads = {m: bytes([m + 1]) * (20000 + m) for m in members}
    arenas = {m: _arena(tmp_path / f"r{m}.arena", 3, payloads[m]) for m in members}
    images = {m: Image(a, a.newest_complete()) for m, a in arenas.items()}
    seg = _encode(tmp_path, members, images, 3)
    for where in (8, seg // 2):  # in the prefix (header/meta/table), then in the data
        def parity_of(m: int, where=where) -> bytes:
            b = bytearray(read_parity(parity_path(tmp_path, "job", 0, m, 3), seg))
            if m == 1:
                b[where] ^= 0x40
            return bytes(b)

        desc = read_trailer(parity_path(tmp_path, "job", 0, 1, 3))["images"]["0"]
        image = rebuild(0, members, seg, desc["len"], parity_of,
                        lambda m, s: images[m].read(s * seg, seg))
        with pytest.raises(CorruptSnapshot):
            land_image(image, desc, tmp_path, "job", 0, 2)
    assert not [p for p in tmp_path.iterdir() if "fetch" in p.name]  # nothing left behind


def test_sets_take_one_rank_per_node_in_groups_of_k():
    nodes = {r: f"n{r // 2}" for r in range(10)}  # 5 nodes of 2 ranks
    assert parity_sets(nodes, 4) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]  # a last node joins
    assert parity_sets(nodes, 2) == [[0, 2], [1, 3], [4, 6, 8], [5, 7, 9]]
    assert parity_sets(nodes, 5) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert parity_sets({0: "a", 1: "a"}, 3) == []  # one node: nothing to protect against
    with pytest.raises(ValueError, match="same number of ranks"):
        parity_sets({0: "a", 1: "a", 2: "b"}, 2)


def test_the_mode_is_parsed_once_with_clear_errors():
    assert [node_replica_mode(v) for v in (None, False, True, "0", "1", "copy", "xor:4")] == \
        [0, 0, 1, 0, 1, 1, 4]
    s = Settings.from_env({"CUDASNAP_NODE_REPLICA": "xor:3"})
    assert s.node_replica and s.node_parity == 3
    assert Settings.from_env({"CUDASNAP_NODE_REPLICA": "1"}).node_parity == 0
    for bad in ("xor:1", "xor:", "parity", "xor:99"):
        with pytest.raises(ConfigError, match="node_replica"):
            node_replica_mode(bad)


def test_parity_of_the_timeline_after_a_restored_step_is_removed(tmp_path):
    from cudasnap.distributed.parity import drop_parity_newer

    for step in (4, 5, 6):
        parity_path(tmp_path, "job", 0, 1, step).write_bytes(b"x")
    parity_path(tmp_path, "other", 0, 1, 9).write_bytes(b"x")
    assert drop_parity_newer(tmp_path, "job", 4) == 2
    assert [s for *_, s in parity_files(tmp_path, "job")] == [4]
    assert drop_parity_newer(tmp_path, "job", -1) == 1  # nothing restored: every one
    assert [s for *_, s in parity_files(tmp_path, "other")] == [9]


def test_the_leased_slot_is_counted_in_the_arena_limit():
    from cudasnap.config import arena_slots

    assert arena_slots(2, True, 4, "xor:4", 0) == 4
    assert arena_slots(2, True, 4, None, 3) == 4  # from the environment
    assert arena_slots(2, True, 1, "xor:4", 0) == 3  # one rank: no parity
    assert arena_slots(2, True, 4, True, 0) == 3
    with pytest.raises(ConfigError, match="at most 8"):
        arena_slots(7, True, 4, "xor:4", 0)


def _trailer(sid, step, members, holder, seg=64, tag="xor/0/3:5:ab"):
    return {"sid": sid, "step": step, "seg": seg, "members": members, "holder": holder, "tag": tag,
            "images": {str(m): {"len": 100 + m, "plen": 10, "pcrc": 1} for m in members if m != holder}}


def test_plans_need_every_other_members_parity_and_slot():
    members = [0, 1, 2]
    serving = {0: {5: [0]}, 1: {5: [1]}, 2: {5: [2]}}
    full = [(m, _trailer(0, 5, members, m)) for m in members]
    got = plans(full, serving)
    assert sorted(got) == [(0, 5), (1, 5), (2, 5)]
    assert got[(1, 5)]["parity_from"] == {0: 0, 2: 2} and got[(1, 5)]["data_from"] == {0: 0, 2: 2}
    # node 1 lost: its parity file and its slot are gone; ranks 0 and 2 cannot be rebuilt
    lost1 = [e for e in full if e[0] != 1]
    got = plans(lost1, {0: {5: [0]}, 2: {5: [2]}})
    assert sorted(got) == [(1, 5)]
    # a survivor's slot of the step overwritten: nothing
    assert plans(lost1, {0: {5: [0]}, 2: {6: [2]}}) == {}
    # a survivor's parity of another step: nothing
    assert plans([lost1[0], (2, _trailer(0, 6, members, 2))], {0: {5: [0]}, 2: {5: [2]}}) == {}
    # a renumbered survivor: rank 0's slot is held by rank 2's node
    got = plans(lost1, {0: {5: [2]}, 2: {5: [2]}})
    assert got[(1, 5)]["data_from"] == {0: 2, 2: 2}
    assert got[(1, 5)]["descs"] == {0: full[2][1]["images"]["0"], 2: full[0][1]["images"]["2"]}
    # files of step 5 from two rounds (a step number run again after a restore): never mixed
    other = [lost1[0], (2, _trailer(0, 5, members, 2, tag="xor/0/9:5:cd"))]
    assert plans(other, {0: {5: [0]}, 2: {5: [2]}}) == {}
    # two files of one round disagreeing on the lost member's image: nothing
    bad = _trailer(0, 5, members, 2)
    bad["images"]["1"] = {"len": 999, "plen": 10, "pcrc": 1}
    assert plans([lost1[0], (2, bad)], {0: {5: [0]}, 2: {5: [2]}}) == {}


# ------------------------------------------------------------------ live keepers
def _keepers(tmp_path: Path, payloads: dict[int, bytes], step: int):
    from cudasnap.distributed.replica import Replicator

    kv = _KV()
    reps, arenas = [], []
    for r in range(3):
        shm = tmp_path / f"n{r}"
        shm.mkdir()
        a = _arena(shm / f"cudasnap-job-r{r}.arena", step, payloads[r], slots=4)
        arenas.append(a)
        cfg = Settings(node_id=f"n{r}", replica_addr="127.0.0.1", node_replica=True,
                       node_parity=3)
        reps.append(Replicator(kv, Local(r, shm, a, world_size=3), cfg))
    return kv, reps, arenas


@pytest.mark.slow
def test_rounds_encode_one_step_and_keep_its_slot_leased_until_the_next_round(tmp_path):
    payloads = {r: bytes([r + 1]) * (30000 + 1000 * r) for r in range(3)}
    kv, reps, arenas = _keepers(tmp_path, payloads, 5)
    try:
        _wait(lambda: all(r.stats()["parity_step"] == 5 for r in reps))
        assert [r.stats()["parity_set"] for r in reps] == [[0, 1, 2]] * 3
        slot5 = [a.newest_complete() for a in arenas]
        assert [a.leases(s) for a, s in zip(arenas, slot5)] == [1, 1, 1]
        for r in range(3):
            held = reps[r].parity_held()
            assert [(t["step"], t["holder"]) for t in held] == [(5, r)]
            # 1/2 of the longest image (+ alignment), never a full copy
            assert reps[r].stats()["parity_file_bytes"] <= (32000 + 4096) // 2 + 64
        # step 6 on ranks 0 and 1 only: their round of 6 leases it and waits for rank 2;
        # meanwhile step 5 must stay rebuildable: its slots leased, its parity files kept
        new = {r: bytes([r + 7]) * 31000 for r in range(3)}
        slot6 = [_write(a, 6, new[r]) for r, a in enumerate(arenas[:2])]
        _wait(lambda: all(arenas[r].leases(slot6[r]) == 1 for r in (0, 1)))
        time.sleep(0.3)
        assert [a.leases(s) for a, s in zip(arenas, slot5)] == [1, 1, 1]
        assert all(sorted(s for *_, s in parity_files(tmp_path / f"n{r}", "job")) == [5]
                   for r in range(3))
        assert all(r.stats()["parity_step"] == 5 for r in reps)
        # then on rank 2: the round completes, the lease moves, the old files go
        slot6.append(_write(arenas[2], 6, new[2]))
        _wait(lambda: all(r.stats()["parity_step"] == 6 for r in reps))
        _wait(lambda: all(a.leases(s) == 0 for a, s in zip(arenas, slot5)))
        assert [a.leases(s) for a, s in zip(arenas, slot6)] == [1, 1, 1]
        _wait(lambda: sorted(s for *_, s in parity_files(tmp_path / "n0", "job")) == [6])
        # node 1 lost: rank 1 rebuilt from ranks 0 and 2 over their servers, bitwise
        entries = [(r, t) for r in (0, 2) for t in reps[r].parity_held()]
        plan = plans(entries, {0: {6: [0]}, 2: {6: [2]}})[(1, 6)]
        assert reps[1].parity is not None
        a, i, path = reps[1].parity.rebuild(plan, 2)
        try:
            assert bytes(a.data_view(i, len(new[1]))) == new[1]
            assert a.read_table(i) == arenas[1].read_table(slot6[1])
        finally:
            path.unlink()
    finally:
        for r in reps:
            r.stop(clean=True)
    assert all(not parity_files(tmp_path / f"n{r}", "job") for r in range(3))
    assert all(a.leases(s) == 0 for a, s in zip(arenas, slot6))


@pytest.mark.slow
def test_a_member_without_the_agreed_step_aborts_the_round_and_keeps_the_old_one(tmp_path):
    payloads = {r: bytes([r + 1]) * 9000 for r in range(3)}
    kv, reps, arenas = _keepers(tmp_path, payloads, 5)
    try:
        _wait(lambda: all(r.stats()["parity_step"] == 5 for r in reps))
        # rank 2 snapshots step 7 and proposes it; ranks 0 and 1 snapshot 6 and 8 (another
        # cadence), never 7: the round cannot encode one step on every member
        _write(arenas[2], 7, b"c" * 9000)
        _wait(lambda: any(k.endswith("/step") and v.startswith("7:") for k, v in list(kv.d.items())))
        for r in (0, 1):
            _write(arenas[r], 6, b"a" * 9000)
            _write(arenas[r], 8, b"b" * 9000)
        _wait(lambda: sum(r.stats()["parity_aborts"] for r in reps) >= 1)
        time.sleep(0.3)
        aborts = sum(r.stats()["parity_aborts"] for r in reps)
        time.sleep(1.0)  # an aborted step is not proposed again: no abort storm on the store
        assert sum(r.stats()["parity_aborts"] for r in reps) == aborts <= 3
        assert all(r.stats()["parity_step"] == 5 for r in reps)
        assert all(sorted(s for *_, s in parity_files(tmp_path / f"n{r}", "job")) == [5]
                   for r in range(3))
    finally:
        for r in reps:
            r.stop(clean=True)


@pytest.mark.slow
def test_a_long_job_does_not_grow_the_store(tmp_path):
    payloads = {r: bytes([r + 1]) * 5000 for r in range(3)}
    kv, reps, arenas = _keepers(tmp_path, payloads, 5)
    try:
        for step in range(6, 18):
            _wait(lambda step=step: all(r.stats()["parity_step"] == step - 1 for r in reps))
            for r, a in enumerate(arenas):
                _write(a, step, bytes([step + r]) * 5000)
        _wait(lambda: all(r.stats()["parity_step"] == 17 for r in reps))
        rounds = {k.split("/")[2] for k in kv.d if k.startswith("xor/")}
        assert len(rounds) <= 6, sorted(rounds, key=int)  # 13 rounds ran; the old ones' keys went
    finally:
        for r in reps:
            r.stop(clean=True)


# ------------------------------------------------------------------ whole jobs
STEPS = 14


@pytest.mark.slow
@pytest.mark.parametrize("per_node,renumber", [(1, False), (2, False), (1, True)])
def test_node_lost_is_rebuilt_from_parity_bitwise(tmp_path, per_node, renumber):
    # Three nodes, node_replica="xor:3": no node holds a full copy of another's state.
    # Node 1 is lost at step 10 once its round of step 9 completed; its ranks are rebuilt
    # from the survivors' parity files and slots; the job ends as a run without failure.
    # renumber: the restart swaps nodes 0 and 2's ranks (each serves the other's slot).
    env = {"MODE": "ddp" if per_node == 1 else "fsdp", "CUDASNAP_NODE_REPLICA": "xor:3"}
    world = 3 * per_node
    ref = node_launch.reference(tmp_path / "ref", nodes=3, per_node=per_node, steps=STEPS,
                                env={"MODE": env["MODE"]})
    assert ref.ok(), ref.logs()
    r = node_launch.run(tmp_path / "run", nodes=3, per_node=per_node, steps=STEPS, kill_node=1,
                        kill_step=10, env=env, timeout=240, renumber=renumber)
    assert r.ok(), r.logs()
    assert r.kill is not None and r.kill["replica"]["parity_step"] >= 9
    lost = range(per_node, 2 * per_node)
    assert [r.ranks[k]["restore"]["source"] for k in lost] == ["peer-parity"] * per_node, r.logs()
    # renumbered: rank 0 runs where rank 2's arena is, and fetches its own from node 0
    kept = ["peer-memory:2", "peer-memory:0"] if renumber else ["shm"] * (world - per_node)
    assert [r.ranks[k]["restore"]["source"] for k in range(world) if k not in lost] == kept
    assert [r.ranks[k]["start"] for k in range(world)] == [10] * world, r.logs()  # 1 replayed
    assert all(r.ranks[k]["shm"]["guest"] == 0 for k in range(world))  # no full copies
    assert all(r.ranks[k]["shm"]["parity"] > 0 for k in range(world) if k not in lost)
    for k in range(world):
        x, y = r.state(k), ref.state(k)
        assert sorted(x) == sorted(y)
        for name in x:
            assert np.array_equal(x[name], y[name]), (k, name)
    assert not any(r.leaked().values()), r.leaked()
