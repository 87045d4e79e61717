"""Torn-state trials: SIGKILL a training process at random moments of its snapshot copies
and flushes, restore in a new process, and demand (1) the newest COMPLETE snapshot, (2)
every restored tensor from that one step, never a mix, and (3) after training to the
end, a state bitwise equal to an uninterrupted run.

The training processes are forked from a server that imported torch once
(tests/helpers/torn_worker.py); each builds its own model, optimizer and Snapshotter.
Kill moments are drawn from a seeded RNG, scaled by the copy/flush durations the
victims report, so on a slow or busy machine the kills still land inside copies
and flushes; nothing is asserted about timings.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest

from cudasnap._native import native
from cudasnap.format import paths
from cudasnap.storage import posix
from tools.faults.zygote import LineServer

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
DIM = 640  # state: 2 x (640x640 + 640) params + AdamW moments + BN buffers, about 10 MB
STEPS = 11
FLUSH_EVERY = 3
TRIALS = int(os.environ.get("CUDASNAP_TORN_TRIALS", "24"))  # >= 20
SEED = int(os.environ.get("CUDASNAP_TORN_SEED", "20261202"))  # override to explore
TIMEOUT = 90.0

_stats = {"torn_copies": 0, "torn_flushes": 0, "copy_kills": 0, "flush_kills": 0,
          "from_shm": 0, "from_disk": 0, "fresh": 0}


class Zygote(LineServer):
    def __init__(self) -> None:
        super().__init__(HELPERS / "torn_worker.py", 120.0)
        self.ids = iter(range(1, 10**6))
        self.pending: list[str] = []

    def next(self, timeout: float = TIMEOUT) -> str:
        return super().next(timeout)

    def run(self, role: str, **kw) -> tuple[int, int]:
        tid = next(self.ids)
        self.send(cmd="run", id=tid, role=role, **kw)
        while True:
            line = self.next()
            if line.startswith(f"PID {tid} "):
                return tid, int(line.split()[2])
            self.pending.append(line)  # a marker written before the PID line

    def markers(self, tid: int, until, timeout: float = TIMEOUT):
        """Yields (kind, step, payload) of process `tid` until `until` returns True."""
        deadline = time.monotonic() + timeout
        while True:
            if self.pending:
                line = self.pending.pop(0)
            else:
                line = self.next(max(0.1, deadline - time.monotonic()))
            parts = line.split(" ", 4)
            if parts[0] != "M" or int(parts[1]) != tid:
                continue
            kind, step, payload = parts[2], int(parts[3]), json.loads(parts[4])
            if kind == "ERR":
                raise AssertionError(f"training process failed:\n{payload['traceback']}")
            yield kind, step, payload
            if until(kind, step):
                return

    def drain(self, tid: int):
        """Markers of `tid` already received (e.g. written just before a kill)."""
        keep, got = [], []
        for line in self.pending:
            parts = line.split(" ", 4)
            if parts[0] == "M" and int(parts[1]) == tid:
                got.append((parts[2], int(parts[3]), json.loads(parts[4])))
            else:
                keep.append(line)
        self.pending = keep
        return got

    def reap(self, pid: int) -> int:
        self.send(cmd="reap", pid=pid)
        while True:
            line = self.next()
            if line.startswith(f"EXIT {pid} "):
                return int(line.split()[2])
            self.pending.append(line)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def reference(zygote):
    tid, pid = zygote.run("reference", dim=DIM, steps=STEPS)
    ref = {}
    final = None
    for kind, step, payload in zygote.markers(tid, lambda k, s: k == "FINAL", 300.0):
        if kind == "REF":
            ref[step] = payload
        elif kind == "FINAL":
            final = payload
    assert zygote.reap(pid) == 0
    assert sorted(ref) == list(range(-1, STEPS)) and final == ref[STEPS - 1]
    # Sanity: the state changes every step (else "same step" checks prove nothing).
    for k in range(STEPS):
        changed = [n for n in ref[k] if ref[k][n] != ref[k - 1].get(n)]
        assert any(n.startswith("model.") for n in changed)
        assert any(n.startswith("opt.") for n in changed) and "rng.torch" in changed
    return ref


def _trial_plan(i: int) -> dict:
    rnd = random.Random(SEED + i)
    mode = ("copy", "flush")[i % 2]
    source = "shm" if i % 4 in (0, 1) else "disk"
    if mode == "copy":
        # disk restores need a flush before the kill to be interesting (steps 2, 5, 8)
        kill_step = rnd.randint(1 if source == "shm" else FLUSH_EVERY, STEPS - 3)
    else:
        kill_step = rnd.choice([k for k in range(1, STEPS - 2) if k % FLUSH_EVERY == FLUSH_EVERY - 1])
    # Fraction of the expected copy/flush duration to wait after its start marker;
    # > 1 sometimes, so kills also land just after a copy completed.
    return {"mode": mode, "source": source, "kill_step": kill_step,
            "frac": rnd.choice([0.0, rnd.random(), rnd.random(), rnd.random() * 1.5])}


_durations = {"copy": [], "flush": []}


def _estimate(kind: str, default: float) -> float:
    xs = sorted(_durations[kind])
    return xs[len(xs) // 2] if xs else default


def _inspect(arena_path: Path, directory: Path) -> dict:
    """What a supervisor would see after the crash (independent of the restoring process)."""
    C = native()
    seen = {"shm_step": None, "torn_copy": False, "disk_steps": [], "torn_flush": False}
    if arena_path.exists():
        a = C.Arena.open(str(arena_path), False)
        newest = a.newest_complete()
        if newest >= 0:
            seen["shm_step"] = a.slot_info(newest)["step"]
        seen["torn_copy"] = any(a.slot_info(s)["state"] == "WRITING" for s in range(a.num_slots))
        del a
    seen["disk_steps"] = sorted(s.step for s in posix.list_snapshots(directory)
                                if (s.path / paths.MANIFEST).exists())
    seen["torn_flush"] = bool(list(directory.glob("step-*.tmp*")))
    return seen


def _diagnose(got: dict, ref: dict) -> str:
    rows = []
    for name, val in sorted(got.items()):
        steps = [k for k, d in ref.items() if d.get(name) == val]
        rows.append(f"  {name}: matches reference step(s) {steps}")
    return "\n".join(rows)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_torn_trial(zygote, reference, snap_env, trial):
    plan = _trial_plan(trial)
    d = snap_env.dir
    common = dict(dim=DIM, steps=STEPS, flush_every=FLUSH_EVERY, dir=str(d), job=snap_env.job)

    # 1. the victim: snapshots every step, flushes every FLUSH_EVERY steps, killed mid-way
    t0 = time.monotonic()
    timings = {}
    tid, pid = zygote.run("victim", **common)
    target = "S" if plan["mode"] == "copy" else "F"
    last_s = -1
    flushed = []
    for kind, step, payload in zygote.markers(
            tid, lambda k, s: k == target and s == plan["kill_step"]):
        if kind == "S":
            last_s = step
            if payload["copy_s"]:
                _durations["copy"].append(payload["copy_s"])
        elif kind == "f":
            flushed.append(step)
            _durations["flush"].append(payload["flush_s"])
        elif kind in ("FINAL", "IDLE"):
            raise AssertionError("the victim finished before its kill step")
    est = _estimate(plan["mode"], 0.01 if plan["mode"] == "copy" else 0.05)
    time.sleep(plan["frac"] * est)
    os.kill(pid, signal.SIGKILL)
    status = zygote.reap(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    for kind, step, payload in zygote.drain(tid):  # written before it died
        if kind == "S":
            last_s = step
        elif kind == "f":
            flushed.append(step)
    timings["victim"] = time.monotonic() - t0
    _stats[f"{plan['mode']}_kills"] += 1

    # 2. what survived, seen independently of the restoring process
    arena_path = snap_env.arena_path()
    seen = _inspect(arena_path, d)
    _stats["torn_copies"] += seen["torn_copy"]
    _stats["torn_flushes"] += seen["torn_flush"]
    assert arena_path.exists()  # created at step 0, before the kill
    assert seen["shm_step"] is not None and last_s - 1 <= seen["shm_step"] <= last_s + 1, seen
    assert set(flushed) <= set(seen["disk_steps"]), (flushed, seen)
    if plan["source"] == "disk":
        arena_path.unlink()  # e.g. the node rebooted: only the disk is left
        expect = seen["disk_steps"][-1] if seen["disk_steps"] else -1
    else:
        expect = max([seen["shm_step"]] + seen["disk_steps"])

    # 3. a new process restores and trains to the end
    tid, pid = zygote.run("resume", **common)
    restored = final = None
    for kind, step, payload in zygote.markers(tid, lambda k, s: k == "FINAL"):
        if kind == "R":
            restored = (step, payload)
        elif kind == "FINAL":
            final = payload
    assert zygote.reap(pid) == 0
    timings["resume"] = time.monotonic() - t0 - timings["victim"]
    start, info = restored
    source = info["restore"]["source"]
    _stats["from_shm" if source == "shm" else "from_disk" if source == "disk" else "fresh"] += 1
    ctx = f"plan={plan} seen={seen} restore={info['restore']} timings={timings}"
    assert start - 1 == expect, f"restored step {start - 1}, newest COMPLETE is {expect}; {ctx}"
    if plan["source"] == "disk" and expect >= 0:
        assert source == "disk", ctx
    mixed = [n for n, v in info["digests"].items() if reference[start - 1].get(n) != v]
    assert sorted(info["digests"]) == sorted(reference[start - 1])
    assert not mixed, (f"restored state is not step {start - 1} of the reference for {mixed}; "
                       f"{ctx}\n{_diagnose(info['digests'], reference)}")
    diff = [n for n, v in final.items() if reference[STEPS - 1].get(n) != v]
    assert not diff, f"final state differs from the uninterrupted run in {diff}; {ctx}"


@pytest.mark.slow
def test_torn_trials_hit_copies_and_flushes():
    """Reports how often the kills tore a copy / a flush (soft: timing dependent)."""
    total = _stats["copy_kills"] + _stats["flush_kills"]
    if total < TRIALS:
        pytest.skip("the trials did not all run")
    print(f"torn-state trials: {_stats}")
    if not _stats["torn_copies"] or not _stats["torn_flushes"]:
        warnings.warn(f"no kill landed inside a copy or a flush this time: {_stats}")
    assert _stats["from_shm"] and _stats["from_disk"]
