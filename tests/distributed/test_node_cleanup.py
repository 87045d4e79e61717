"""Nothing left behind (issue 35 item 5): node-loss replication's arenas go at a clean end and
by ``cudasnap gc`` once their holder is gone; small states get small slots.

* a whole job of two "nodes" on this host (tools/dist/node_launch.py) loses a node, and
  the restart gives each node the other's ranks: after its clean end neither node's shared
  memory holds an arena of the job (old own arenas of the renumbered ranks, guest copies
  claimed at start, guests received since, temporaries);
* the clean-end sweep and ``cudasnap gc`` remove an arena whose holder is gone (or, the
  sweep, one this process holds) and never one a live process of the node holds;
* a small state's arena is a small multiple of it (the chunk follows the state), and a
  guest arena made from its replica follows.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cudasnap import _native
from cudasnap.core.slot_geometry import chunk_for
from cudasnap.distributed.replica_store import GuestStore, guest_path, make_arena, sweep
from cudasnap.distributed.replica_wire import WireError, slot_header
from cudasnap.snapshotter import Snapshotter
from cudasnap.tools import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dist"))
import node_launch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 16

# Claims the arenas named on its command line, says "ready", then exits ("dead") or holds
# them until its stdin closes ("live").
_HOLDER = ("import sys, torch\n"
           "from cudasnap._native import native\n"
           "for p in sys.argv[2:]:\n"
           "    native().Arena.open(p, True, False).claim_owner()\n"
           "print('ready', flush=True)\n"
           "if sys.argv[1] == 'live':\n"
           "    sys.stdin.read()\n")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def _holder(kind: str, *paths: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, kind, *map(str, paths)], env=_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    if kind == "dead":
        assert p.wait(timeout=120) == 0
    return p


def _arena(path: Path, job: str) -> Path:
    _native.native().Arena.create(str(path), 2, 64 << 10, 4096, 4096, job, False)
    return path


def _owner(path: Path) -> int:
    return int(_native.native().Arena.open(str(path), False, False).owner_pid)


def _node(shm: Path, job: str) -> dict[str, Path]:
    """One node's shared memory after a renumbering restart: arenas held by a dead
    process (an old own arena, a guest), by a live one (its guest), by this process (its
    own arena, a guest it claimed), another job's, and two temporaries."""
    shm.mkdir()
    a = {n: _arena(shm / f"cudasnap-{job}-{n}.arena", job) for n in ("r0", "r2", "g0", "g1", "g3")}
    a["other"] = _arena(shm / f"cudasnap-{job}x-g0.arena", f"{job}x")
    return a


@pytest.mark.slow  # ~4 s: two holder processes load the extension
def test_sweep_and_gc_remove_what_a_dead_process_held_never_a_live_ones(tmp_path, capsys,
                                                                       monkeypatch):
    job = f"cl{os.getpid()}"
    a, g = _node(tmp_path / "sweep", job), _node(tmp_path / "gc", job)
    # a dead process held a renumbered rank's own arena and a guest (and another job's);
    # a live one (another rank of the node) holds its guest g1; this process the rest
    dead = _holder("dead", *(x[k] for x in (a, g) for k in ("r2", "g0", "other")))
    live = _holder("live", a["g1"], g["g1"])
    try:
        assert _owner(a["g1"]) == live.pid and _owner(a["r2"]) == dead.pid
        assert _owner(a["g3"]) == os.getpid()
        shm = a["r0"].parent
        tmp_dead = shm / f".cudasnap-{job}-fetch-r1-{dead.pid}.arena"
        tmp_live = shm / f".cudasnap-{job}-g3.arena.tmp-{live.pid}"
        for t in (tmp_dead, tmp_live):
            t.write_bytes(b"x")
        # the clean end of this process (its own arena r0 is its Snapshotter's to remove)
        gone = sweep(shm, job, keep=a["r0"])
        assert sorted(p.name for p in gone) == sorted(
            [a["r2"].name, a["g0"].name, a["g3"].name, tmp_dead.name])
        assert sorted(p.name for p in shm.iterdir()) == sorted(
            [a["r0"].name, a["g1"].name, a["other"].name, tmp_live.name])

        # `cudasnap gc`: every job's arenas whose holder is gone, never a live holder's
        gshm = g["r0"].parent
        g_dead = gshm / f".cudasnap-{job}-g3.arena.tmp-{dead.pid}"
        g_live = gshm / f".cudasnap-{job}-fetch-r0-{live.pid}.arena"
        for t in (g_dead, g_live):
            t.write_bytes(b"x")
        monkeypatch.setenv("CUDASNAP_SHM_DIR", str(gshm))
        capsys.readouterr()
        assert cli.main(["gc", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"would remove {g['other']} (owner {dead.pid} gone)" in out, out
        assert f"would remove {g_dead} (owner {dead.pid} gone)" in out, out
        assert f"keep   {g_live} (pid {live.pid} alive)" in out, out
        assert f"keep   {g['g1']} (pid {live.pid} alive)" in out, out
        assert "4 stale arena(s) found" in out and g_dead.exists(), out
        assert cli.main(["gc"]) == 0
        assert "4 stale arena(s) removed" in capsys.readouterr().out
        assert sorted(p.name for p in gshm.iterdir()) == sorted(
            [g["r0"].name, g["g1"].name, g["g3"].name, g_live.name])
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(timeout=60)


def _small_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # ~0.2 M parameters + AdamW's moments: ~0.9 MB a slot
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _land(src, slot: int, guests: GuestStore, rank: int) -> dict:
    """Sends ``src``'s slot through a socketpair into ``guests`` (as rank ``rank``'s)."""
    from tests.distributed.test_node_loss import _transfer

    return _transfer(src, slot, lambda sock, hdr: guests.receive(sock, hdr, rank))


@pytest.mark.slow  # ~3 s: a Snapshotter, its arena, a guest of it
def test_a_small_state_gets_a_small_arena_and_its_guest_follows(snap_env, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    model, opt = _small_job()
    snap = Snapshotter(model, opt, directory=snap_env.dir, shm_dir=shm, health=False,
                       copy_threads=1)
    try:
        for step in range(3):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            snap.boundary(step)
        assert snap.wait(60)
        C = _native.native()
        own = C.Arena.open(str(snap.arena_path), False, False)
        slot = own.newest_complete()
        info = own.slot_info(slot)
        state = int(info["data_bytes"])
        assert 0.5e6 < state < 2e6 and info["step"] == 2
        # the chunk follows the state (a 4 MiB one: ~6x the state a slot), CRC per chunk
        assert own.chunk_bytes == chunk_for(state) and own.chunk_bytes <= state // 2
        assert own.chunk_bytes % 4096 == 0 and info["num_chunks"] >= 2
        assert C.verify_buffer(own.data_ptr(slot), state, own.chunk_bytes,
                               own.read_table(slot), 1) == -1
        slots = own.num_slots
        alloc = snap.arena_path.stat().st_blocks * 512
        assert alloc <= slots * 2 * state, (alloc, slots, state)
        # a guest arena made from its replica takes its geometry: small too
        guests = GuestStore(shm, snap_env.job)
        got = _land(own, slot, guests, 5)
        assert got.get("value") == 2, got
        g = guest_path(shm, snap_env.job, 5)
        guest = C.Arena.open(str(g), False, False)
        assert guest.chunk_bytes == own.chunk_bytes
        assert g.stat().st_blocks * 512 <= guest.num_slots * 2 * state
        # a clean end: the guest goes, and one landing after it removes itself
        assert guests.close() == [g] and not g.exists()
        late = _land(own, slot, guests, 6)
        assert isinstance(late.get("error"), WireError), late
        assert not guest_path(shm, snap_env.job, 6).exists()
        tmp = make_arena(shm / "exact.arena", slot_header(own, slot), snap_env.job, exact=True)
        assert tmp.chunk_bytes == own.chunk_bytes  # a fetched copy: the sender's chunk
    finally:
        snap.close()
    assert chunk_for(0) == 4096 and chunk_for(16 << 20) == chunk_for(8 << 30) == 4 << 20
    assert chunk_for(1 << 20) == 256 << 10
    assert chunk_for(state, limit=16 << 10) == 16 << 10  # an explicit chunk_bytes: at most


@pytest.mark.slow
def test_renumbered_clean_end_leaves_no_arena_on_either_node(tmp_path):
    # two ranks a node; node 1 is lost at step 10; the restart gives node 0 ranks 2, 3
    # (restored from the guests it holds) and the new node 1 ranks 0, 1 (fetched from
    # node 0's own arenas r0, r1 of the first numbering)
    before: dict[str, list[str]] = {}

    def look(r: node_launch.NodeRun) -> None:
        before["node0"] = sorted(n for n in os.listdir(tmp_path / "shm-node0")
                                 if not n.startswith("."))

    r = node_launch.run(tmp_path, per_node=2, steps=STEPS, kill_node=1, kill_step=10,
                        renumber=True, between=look, timeout=240)
    assert r.ok(), r.logs()
    job = r.job
    assert before["node0"] == sorted(f"cudasnap-{job}-{k}.arena"
                                     for k in ("r0", "r1", "g2", "g3")), before
    assert {r.ranks[k]["restore"]["source"] for k in (2, 3)} == {"peer-memory:local"}, r.logs()
    assert all(r.ranks[k]["restore"]["source"].startswith("peer-memory:") for k in (0, 1))
    assert {r.ranks[k]["start"] for k in range(4)} == {10}
    assert all(r.ranks[k]["shm"]["guest"] > 0 for k in (2, 3))  # g2, g3 still held then
    assert r.left.keys() == {0, 1}
    assert r.leaked() == {0: [], 1: []}, (r.left, r.logs())
