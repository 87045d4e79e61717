"""Runs an in-process-restart job (tools/stacks/inprocess_train.py) and kills one of its ranks
from outside: for tests/distributed/test_inprocess.py and bench/recovery.py.

``run(work, world, spares, ...)`` hosts the control store (a TCPStore on 127.0.0.1 in this
process: not a rank, so no rank's death takes it), starts ``world`` ranks and ``spares``
spares (uids ``world..``), SIGKILLs uid ``victim`` once it logged step ``kill_after`` plus a
random share of a step, and waits for every process. ``reference(work, world)`` is the same
training without cudasnap and without a kill. ``Trial`` tells what happened: each rank's
dump, the pids each uid ran as, the step each rank resumed at, the seconds from the kill to
every rank's first step of the next generation.
"""
from __future__ import annotations

import datetime
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "stacks" / "inprocess_train.py"
STEP_RE = re.compile(r"\[ip\] uid=(\d+) rank=(\d+) step=(\d+) t=([\d.]+)")
START_RE = re.compile(r"\[ip\] uid=(\d+) pid=(\d+) gen=(\d+) rank=(\d+) start=(\d+) src=(\S+)")


@dataclass
class Trial:
    rc: dict[int, int | None] = field(default_factory=dict)  # exit status per uid
    log: list[tuple[float, int, str]] = field(default_factory=list)
    killed_at: float | None = None
    killed_after_step: int | None = None  # the victim's newest step logged before the kill
    starts: list[dict[str, Any]] = field(default_factory=list)  # one per attempt start
    out: Path | None = None

    def text(self, n: int = 80) -> str:
        return "\n".join(f"{t:.3f} uid{u} {ln.rstrip()}" for t, u, ln in self.log[-n:])

    def recovered_s(self, world: int) -> float | None:
        """Kill -> every rank of the job after it executed its first step (logged it): for
        each attempt start logged after the kill, its process's first step line after it."""
        if self.killed_at is None:
            return None
        after = [st for st in self.starts if st["t"] > self.killed_at]
        if len({st["rank"] for st in after}) < world:
            return None
        firsts = []
        for st in after:
            t = next((t for t, _, ln in self.log if t > st["t"]
                      and (m := STEP_RE.search(ln)) and int(m.group(1)) == st["uid"]), None)
            if t is None:
                return None
            firsts.append(t)
        return max(firsts) - self.killed_at

    def replayed(self) -> int | None:
        """Steps logged before the kill that the job trained again (the newest step the
        victim logged + 1 - the step the job resumed at)."""
        after = {st["start"] for st in self.starts if self.killed_at and st["t"] > self.killed_at}
        if self.killed_after_step is None or len(after) != 1:
            return None
        return self.killed_after_step + 1 - after.pop()

    def dumps(self, world: int) -> list[dict[str, Any]]:
        import torch

        assert self.out is not None
        return [torch.load(self.out / f"rank-{r}.pt", weights_only=False) for r in range(world)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _readers(procs: list[subprocess.Popen[str]], trial: Trial) -> list[threading.Thread]:
    """One thread per process collecting its lines (and the attempt starts) into ``trial``."""
    readers = []
    for uid, p in enumerate(procs):
        def read(u: int = uid, q: subprocess.Popen[str] = p) -> None:
            assert q.stdout is not None
            for ln in q.stdout:
                trial.log.append((time.time(), u, ln))
                m = START_RE.search(ln)
                if m:
                    trial.starts.append({"t": time.time(), "uid": int(m.group(1)),
                                         "pid": int(m.group(2)),
                                         "gen": int(m.group(3)), "rank": int(m.group(4)),
                                         "start": int(m.group(5)), "src": m.group(6)})
        t = threading.Thread(target=read, daemon=True)
        t.start()
        readers.append(t)
    return readers


def _start(n: int, env_of: Any, trial: Trial) -> tuple[list[subprocess.Popen[str]],
                                                     list[threading.Thread]]:
    procs = [subprocess.Popen([sys.executable, str(SCRIPT)], env=env_of(uid), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
             for uid in range(n)]
    return procs, _readers(procs, trial)


def _finish(procs: list[subprocess.Popen[str]], readers: list[Any], trial: Trial,
            timeout: float) -> None:
    end = time.monotonic() + timeout
    for uid, p in enumerate(procs):
        try:
            trial.rc[uid] = p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            trial.rc[uid] = None
    for p in procs:
        p.wait()
    for t in readers:
        t.join(timeout=5)


def _base_env(work: Path, steps: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "CUDASNAP_HEALTH": "0", "OUT": str(work / "out"), "STEPS": str(steps)})
    return env


def reference(work: Path, world: int, steps: int, timeout: float = 120) -> Trial:
    """The same training on ``world`` ranks, no cudasnap, no kill."""
    port = _free_port()
    trial = Trial(out=work / "out")

    def env_of(uid: int) -> dict[str, str]:
        return {**_base_env(work, steps), "REF": "1", "CUDASNAP_UID": str(uid), "RANK": str(uid),
                "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    procs, readers = _start(world, env_of, trial)
    _finish(procs, readers, trial, timeout)
    return trial


def classic(work: Path, world: int, steps: int, victim: int, kill_after: int,
            rng: random.Random, timeout: float = 180, step_s: float = 0.03,
            spares: int | None = None) -> Trial:
    """The same job without in-process restart, as cudasnap runs it today: ``cudasnap run
    -- torchrun --max-restarts=0``; rank ``victim``'s process SIGKILLed after its step
    ``kill_after``; ``cudasnap run`` restarts every process (from shared memory).
    ``spares`` (not None): the job under ``cudasnap run --inprocess --spares N`` instead
    (with 0, its fallback: a full restart)."""
    trial = Trial(out=work / "out")
    env = {**_base_env(work, steps), "CKPT": str(work / "ckpt"),
           "CUDASNAP_JOB": f"ipc{uuid.uuid4().hex[:8]}"}
    cmd = [sys.executable, "-m", "cudasnap", "run", "--dir", str(work / "ckpt"),
           "--max-restarts", "3"]
    if spares is None:
        env["CLASSIC"] = "1"
        cmd += ["--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={world}", "--max-restarts=0", "--monitor-interval=0.1",
                str(SCRIPT)]
    else:
        cmd += ["--inprocess", f"--nproc={world}", f"--spares={spares}", "--",
                sys.executable, str(SCRIPT)]
    p = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    readers = _readers([p], trial)
    end = time.monotonic() + timeout
    while trial.killed_at is None and time.monotonic() < end and p.poll() is None:
        done = _steps_of(trial, victim)
        if done and max(done) >= kill_after:
            time.sleep(rng.random() * step_s)
            pid = [st["pid"] for st in trial.starts if st["uid"] == victim][-1]
            trial.killed_after_step = max(_steps_of(trial, victim))
            os.kill(pid, signal.SIGKILL)
            trial.killed_at = time.time()
        time.sleep(0.002)
    _finish([p], readers, trial, max(1.0, end - time.monotonic()))
    trial.rc = {r: trial.rc.get(0) for r in range(world)}
    for f in Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm")).glob(
            f"*cudasnap-{env['CUDASNAP_JOB']}-*"):
        f.unlink(missing_ok=True)
    return trial


def _steps_of(trial: Trial, uid: int) -> list[int]:
    return [int(m.group(3)) for _, _, ln in list(trial.log)
            for m in [STEP_RE.search(ln)] if m and int(m.group(1)) == uid]


def _node_env(work: Path, world: int, nodes: int, uid: int) -> dict[str, str]:
    """A "node" of its own for ``uid`` when the job spans ``nodes`` (> 1): its node id, its
    shared-memory directory and its replica address; the spares (uids ``world..``) on a
    node of their own, new to the job (a lost node is replaced by another)."""
    if nodes <= 1:
        return {}
    n = min(uid // (world // nodes), nodes)
    shm = work / f"shm-node{n}"
    shm.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {"CUDASNAP_NODE_ID": f"node{n}", "CUDASNAP_SHM_DIR": str(shm),
            "CUDASNAP_REPLICA_ADDR": f"127.0.0.{10 + n}", "CUDASNAP_NODE_REPLICA": "1"}


def run(work: Path, world: int, spares: int, steps: int, victim: int | None,
        kill_after: int, rng: random.Random, timeout: float = 120,
        step_s: float = 0.03, nodes: int = 1) -> Trial:
    """One job under in-process restart; ``victim``: the uid SIGKILLed after its step
    ``kill_after`` and a random share of a step (None: no kill). ``nodes`` > 1: the ranks
    spread over that many "nodes" (own node id, shared memory and replica address each,
    CUDASNAP_NODE_REPLICA=1) and the victim's whole node is lost: every process of it
    SIGKILLed at once and its shared memory removed."""
    import shutil

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    job = f"ip{uuid.uuid4().hex[:8]}"
    trial = Trial(out=work / "out")

    def env_of(uid: int) -> dict[str, str]:
        return {**_base_env(work, steps), "CUDASNAP_CONTROL": f"127.0.0.1:{store.port}",
                "CUDASNAP_UID": str(uid), "CUDASNAP_WORLD": str(world),
                "CUDASNAP_NPROC": str(world + spares), "CKPT": str(work / "ckpt"),
                "CUDASNAP_JOB": job, **_node_env(work, world, nodes, uid)}

    per_node = world // max(nodes, 1)
    procs, readers = _start(world + spares, env_of, trial)
    try:
        end = time.monotonic() + timeout
        while victim is not None and trial.killed_at is None and time.monotonic() < end:
            done = _steps_of(trial, victim)
            if done and max(done) >= kill_after:
                time.sleep(rng.random() * step_s)
                trial.killed_after_step = max(_steps_of(trial, victim))
                lost = ([u for u in range(world) if u // per_node == victim // per_node]
                        if nodes > 1 else [victim])
                for u in lost:
                    procs[u].send_signal(signal.SIGKILL)
                trial.killed_at = time.time()
                if nodes > 1:  # the node's memory is gone with it
                    shutil.rmtree(work / f"shm-node{victim // per_node}", ignore_errors=True)
            time.sleep(0.002)
        _finish(procs, readers, trial, max(1.0, end - time.monotonic()))
    finally:
        shm = [Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))]
        shm += [work / f"shm-node{n}" for n in range(nodes + 1)] if nodes > 1 else []
        for d in shm:
            for p in d.glob(f"*cudasnap-{job}-*"):
                p.unlink(missing_ok=True)
    return trial
