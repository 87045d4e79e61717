"""The end of a multi-rank job (issue 23 item 1): ``flush()`` on every rank, then ``close()``,
with one rank late to its last boundary (tools/dist/end_of_job_worker.py, 2 ranks,
gloo on CPU). The late rank's lateness is gated on the store: it reaches its last
boundary only after its part of the others' flush round has published its COMPLETE
steps without the last one, so the round has to wait for it; and it closes only after
the others have closed and exited, so its peer monitor has to tell a peer that ended
from a peer that failed.

Expected: no restart (every rank in its first attempt, exit 0), ``latest`` is the last
step, and every rank's ``flush()`` returns well under the peer silence timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cudasnap.distributed.kv import KV
from cudasnap.distributed.liveness import Liveness
from cudasnap.format import paths
from cudasnap.storage import listing
from tools.dist import launch

SCRIPT = Path(launch.__file__).with_name("end_of_job_worker.py")
STEPS = 6
WORLD = 2
PEER_TIMEOUT_S = 10.0  # the default: a flush that waited out a "silent" peer takes this long
HB_S = 0.02  # the unit tests' heartbeat: a peer lags after 2 of them
QUICK_S = 4.0  # well under it: the late rank's 0.5 s, the monitor's join, the writes


class _Store:
    """The c10d Store calls the coordinator's KV makes, over a dict; ``script`` scripts the
    successive values one key reads as (the last one then stays)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}
        self.script: dict[str, list[str]] = {}

    def set_timeout(self, _t: object) -> None:
        pass

    def set(self, k: str, v: str) -> None:
        self.d[k] = v.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d or k in self.script for k in keys)

    def get(self, k: str) -> bytes:
        seq = self.script.get(k)
        if seq:
            return (seq.pop(0) if len(seq) > 1 else seq[0]).encode()
        return self.d[k]

    def compare_set(self, k: str, old: str, new: str) -> bytes:
        if k not in self.d:
            self.d[k] = new.encode()
        return self.d[k]


def _liveness(store: _Store) -> Liveness:
    kv = KV("t/", store=store, monitor_store=store)  # type: ignore[arg-type]
    return Liveness(kv, 0, 2, 10.0, lambda: [4, 5], lambda: 5, heartbeat_s=HB_S)


def _dead_peer(store: _Store) -> None:
    """Rank 1, on this host, lags a heartbeat and its presence port refuses connections
    (its process is gone)."""
    import socket

    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    store.set("t/proc/1", f"127.0.0.1:{port}")
    store.set("t/host/1", socket.gethostname())


def test_a_peer_whose_process_is_gone_is_dead_unless_it_closed() -> None:
    store = _Store()
    live = _liveness(store)
    _dead_peer(store)
    store.set("t/hb/1", "7:5:4,5")
    found = live.check()  # its heartbeat just seen: not probed
    time.sleep(3 * HB_S)  # its heartbeat lags: its port is probed, and refuses
    found += live.check()
    assert found == [1] and live.dead == {1}

    store = _Store()
    live = _liveness(store)
    _dead_peer(store)
    store.set("t/hb/1", "closed:5")  # close() with step 5 committed, then exited
    assert live.check() == [] and live.dead == set() and live.closed == {1: 5}
    time.sleep(3 * HB_S)
    assert live.check() == []  # and stays closed

    # Closed (and exited) between the read of its heartbeat and the look at its process.
    store = _Store()
    live = _liveness(store)
    _dead_peer(store)
    store.script["t/hb/1"] = ["7:5:4,5", "7:5:4,5", "closed:5"]
    assert live.check() == []  # seen: not probed yet (on this node: no verification)
    time.sleep(3 * HB_S)  # its heartbeat lags: probed, refused, then its closed marker read
    assert live.check() == [] and live.closed == {1: 5}


def test_the_closed_marker_is_the_last_heartbeat() -> None:
    store = _Store()
    live = _liveness(store)
    live.beat()
    assert store.d["t/hb/0"].decode().endswith(":5:4,5")
    live.close(5)
    live.beat()  # a monitor thread's beat after close() does not overwrite it
    assert store.d["t/hb/0"] == b"closed:5"


def _latest(ckpt: Path) -> int | None:
    latest = ckpt / paths.LATEST
    return int(latest.read_text().strip().rsplit("-", 1)[-1]) if latest.exists() else None


def _check(ckpt: Path, out: Path, log: str) -> None:
    ranks = {}
    for r in range(WORLD):
        f = out / f"rank-{r}.json"
        assert f.exists(), f"rank {r} wrote no result\n{log}"
        ranks[r] = json.loads(f.read_text())
    for r, info in ranks.items():
        assert (info["attempt"], info["restart"], info["start"]) == (0, 0, 0), \
            f"rank {r} was restarted: {info}\n{log}"
    late = ranks[1]["gate"]
    assert late["have"] is not None and str(STEPS - 1) not in late["have"].split(","), \
        f"the late rank was not gated on the others' round: {late}"
    assert _latest(ckpt) == STEPS - 1, \
        f"latest is step {_latest(ckpt)}, not the last step {STEPS - 1}\n{log}"
    step_dir = ckpt / paths.step_dirname(STEPS - 1)
    assert listing.read_commit(step_dir)["present"] == list(range(WORLD))
    for r, info in ranks.items():
        assert info["flush_path"] == str(step_dir / paths.rank_dirname(r)), (r, info)
        assert info["flush_s"] < QUICK_S, \
            f"rank {r}'s flush() took {info['flush_s']:.1f} s (silence timeout " \
            f"{PEER_TIMEOUT_S:.0f} s)\n{log}"
    assert "is silent" not in log and "peer failure" not in log and "is gone" not in log, log


def _run(tmp_path: Path, max_restarts: int = 1, **env: str) -> tuple[launch.Run, str]:
    r = launch.run(tmp_path, nproc=WORLD, max_restarts=max_restarts, script=SCRIPT,
                   timeout=180, env={"STEPS": str(STEPS), "CUDASNAP_PEER_TIMEOUT_S":
                                     str(PEER_TIMEOUT_S), **env})
    launch.cleanup_arenas(r.job)
    return r, f"rc={r.rc} after {r.seconds:.0f} s\n{launch.log_tail(r, 80)}"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "every"), [("plain", 1), ("fsdp", 1), ("plain", 4)],
                         ids=["plain", "fsdp2", "plain-snapshot_every4"])
def test_late_rank_at_the_end_of_the_job_under_torchrun(tmp_path: Path, mode: str,
                                                        every: int) -> None:
    """snapshot_every=4: the last boundary (5) is not copied; the late rank copies its live
    state while the round waits for it."""
    r, log = _run(tmp_path, MODE=mode, SNAPSHOT_EVERY=str(every))
    assert r.rc == 0, log
    _check(r.ckpt, r.out, log)


def _flush_events(r: launch.Run, rank: int) -> list[dict]:
    return [e for e in r.events() if e["rank"] == rank and e["event"] in
            ("flush_start", "agreed", "committed", "commit_failed")]


@pytest.mark.slow
def test_explicit_flush_waits_for_a_live_rank_only_up_to_its_bound(tmp_path: Path) -> None:
    """A live rank that never reaches the step the explicit flush asks for (it skips its
    last boundary): the round agrees on the step every rank has once the agreement bound
    (peer timeout + 4 heartbeats) has passed, and the job ends normally."""
    timeout_s = 3.0
    r, log = _run(tmp_path, max_restarts=0, MODE="plain", SCENARIO="stuck",
                  CUDASNAP_PEER_TIMEOUT_S=str(timeout_s))
    assert r.rc == 0, log
    assert _latest(r.ckpt) == STEPS - 2, log
    ranks = {k: json.loads((r.out / f"rank-{k}.json").read_text()) for k in range(WORLD)}
    assert ranks[1]["gate"]["request"] == "0", ranks  # rank 0 opened the round
    assert timeout_s <= ranks[0]["flush_s"] < timeout_s + 4 * 0.5 + QUICK_S, (ranks, log)
    assert "did not complete step 5 (the explicit flush's)" in r.log, log
    assert "is silent" not in r.log and "peer failure" not in r.log, log


@pytest.mark.slow
def test_explicit_flush_does_not_wait_for_a_dead_rank(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed before its last boundary: rank 0's explicit flush agrees on the
    step before it (rank 1's arena has it) as soon as rank 1 is found dead, not after the
    agreement bound (torchrun then fails the job: rank 1 was killed)."""
    r, log = _run(tmp_path, max_restarts=0, MODE="plain", SCENARIO="dead")
    assert r.rc != 0, log
    assert json.loads((r.out / "kill.json").read_text())["step"] == STEPS - 1
    ev = _flush_events(r, 0)
    start = next(e for e in ev if e["event"] == "flush_start")
    assert start.get("target") == STEPS - 1, ev
    agreed = next(e for e in ev if e["event"] == "agreed" and e["gen"] == start["gen"])
    assert agreed["t"] - start["t"] < QUICK_S, ev  # the bound is 10 s + 4 heartbeats
    assert _latest(r.ckpt) == STEPS - 2, log
    assert listing.read_commit(r.ckpt / paths.step_dirname(STEPS - 2))["present"] == [0, 1]


@pytest.mark.slow
def test_late_rank_at_the_end_of_the_job_under_cudasnap_run(tmp_path: Path) -> None:
    """``cudasnap run -- torchrun ...``: the job is not restarted (before the fix rank 1
    exited 79 after waiting for rank 0, and the whole job ran again from the step before
    the last)."""
    ckpt, out, store = tmp_path / "ckpt", tmp_path / "out", tmp_path / "store"
    store.mkdir()
    job = launch.new_job()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"OUT": str(out), "STORE_DIR": str(store), "MODE": "fsdp", "STEPS": str(STEPS),
                "CUDASNAP_JOB": job, "CUDASNAP_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
                "PYTHONPATH": str(launch.REPO), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "cudasnap", "run", "--dir", str(ckpt), "--max-restarts", "1",
           "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={WORLD}", "--max-restarts=0", "--monitor-interval=0.1",
           f"--rdzv-id={uuid.uuid4().hex[:8]}", str(SCRIPT)]
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=240)
    finally:
        launch.cleanup_arenas(job)
    log = f"rc={p.returncode}\n" + "\n".join(p.stdout.splitlines()[-80:])
    assert p.returncode == 0, log
    assert "restarting" not in p.stdout, log
    _check(ckpt, out, log)
