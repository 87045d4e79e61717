"""Several "nodes" on one host for the node-loss tests and bench/node_loss.py.

Each node is a group of rank processes (tools/dist/node_train.py) with its own
CUDASNAP_NODE_ID, its own shared-memory directory (CUDASNAP_SHM_DIR) and its own replica
address (127.0.0.<n>); all share the snapshot directory and a FileStore per attempt. A
"node loss" is the SIGKILL of every process of the job once the victim rank died (a
torchrun agent restarts its survivors' workers the same way) and the removal of the lost
nodes' shared-memory directories; attempt 1 starts every rank again, the replaced nodes with
new, empty shared memory and a new node id. (tests/distributed/test_node_loss_torchrun.py runs the same
with two real torchrun agents.)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("node_train.py")


@dataclass
class NodeRun:
    base: Path
    job: str
    rcs: list[dict[int, int | None]] = field(default_factory=list)  # per attempt: rank -> rc
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    kill: dict[str, Any] | None = None
    t_lost: float | None = None  # when the victim's death was seen
    # survivors="wait": seconds from the victim's death seen to each survivor's own exit
    survivor_exit: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    # what each node's shared-memory directory still held at the end, before its removal
    left: dict[int, list[str]] = field(default_factory=dict)

    def leaked(self) -> dict[int, list[str]]:
        """The arenas of this job (own, guest, temporary) left in each node's shared
        memory at the end."""
        return {n: [f for f in names if f.lstrip(".").startswith(f"cudasnap-{self.job}-")]
                for n, names in self.left.items()}

    @property
    def out(self) -> Path:
        return self.base / "out"

    @property
    def ckpt(self) -> Path:
        return self.base / "ckpt"

    def state(self, rank: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"rank-{rank}.npz") as z:
            return {k: z[k] for k in z.files}

    def logs(self) -> str:
        parts = []
        for p in sorted((self.base / "logs").glob("*.log")):
            parts.append(f"==== {p.name}\n" + "\n".join(
                ln for ln in p.read_text(errors="replace").splitlines()
                if "FutureWarning" not in ln and "pynvml" not in ln)[-6000:])
        return "\n".join(parts)

    def ok(self) -> bool:
        return bool(self.rcs) and all(rc == 0 for rc in self.rcs[-1].values())


def _start(base: Path, rank: int, world: int, node: int, node_id: str, shm: Path,
           attempt: int, env: dict[str, str]) -> subprocess.Popen:
    e = dict(os.environ)
    e.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
              "ATTEMPT": str(attempt), "CUDASNAP_RESTART": str(attempt),
              "CUDASNAP_NODE_ID": node_id, "CUDASNAP_SHM_DIR": str(shm),
              "CUDASNAP_REPLICA_ADDR": f"127.0.0.{10 + node + 20 * attempt}",
              "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
              "PYTHONUNBUFFERED": "1", "CUDASNAP_HEALTH": "0"})
    e.update(env)
    logf = open(base / "logs" / f"a{attempt}-r{rank}.log", "w")  # noqa: SIM115 - closed by the OS
    return subprocess.Popen([sys.executable, str(WORKER)], env=e, stdout=logf,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_all(procs: dict[int, subprocess.Popen], deadline: float) -> dict[int, int | None]:
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    out = {}
    for r, p in procs.items():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            out[r] = None  # timed out
        else:
            out[r] = p.returncode
    return out


def run(base: Path, *, nodes: int = 2, per_node: int = 1, steps: int = 30,
        env: dict[str, str] | None = None, kill_node: int | None = None,
        kill_step: int = -1, kill_when: str = "acked", lose: tuple[int, ...] | None = None,
        timeout: float = 240.0, job: str | None = None,
        shm_root: Path | None = None, between: Any = None, renumber: bool = False,
        survivors: str = "kill") -> NodeRun:
    """Attempt 0 (with a node loss at ``kill_step`` when ``kill_node`` is set: that node's
    first rank dies, then every process; the nodes in ``lose`` (default: the killed one)
    lose their shared memory), then attempt 1 to the end; ``between(run)`` is called between
    the two attempts; ``renumber``: in attempt 1 node n runs node (nodes-1-n)'s ranks;
    ``survivors``: "kill" (every process of the job is killed once the victim died) or
    "wait" (only the lost node's processes are; the others exit on their own, as the
    health guard makes them: their exit times are ``survivor_exit``)."""
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    for d in ("out", "ckpt", "store", "logs"):
        (base / d).mkdir(exist_ok=True)
    job = job or f"node-{uuid.uuid4().hex[:10]}"
    r = NodeRun(base=base, job=job)
    world = nodes * per_node
    common = {"CKPT": str(r.ckpt), "OUT": str(r.out), "STORE_DIR": str(base / "store"),
              "CUDASNAP_JOB": job, "STEPS": str(steps), "CUDASNAP_NODE_REPLICA": "1",
              "KILL_STEP": str(kill_step), "KILL_WHEN": kill_when,
              "KILL_RANK": str(-1 if kill_node is None else kill_node * per_node),
              "KILL_NODE_RANKS": "" if kill_node is None else ",".join(
                  str(kill_node * per_node + i) for i in range(per_node))}
    common.update(env or {})
    shm_root = shm_root or base  # the bench: a tmpfs directory, as /dev/shm
    shm_root.mkdir(parents=True, exist_ok=True)
    shm = {n: shm_root / f"shm-node{n}" for n in range(nodes)}
    node_ids = {n: f"node{n}" for n in range(nodes)}
    for d in shm.values():
        d.mkdir(mode=0o700, exist_ok=True)
    attempts = 1 if kill_node is None else 2
    try:
        for attempt in range(attempts):
            deadline = time.monotonic() + timeout
            # renumber: in attempt 1 the nodes take each other's ranks (node n runs the
            # ranks of node nodes-1-n), as an elastic restart may order the nodes anew
            procs = {}
            for n in range(nodes):
                m = nodes - 1 - n if renumber and attempt == 1 else n
                for i in range(per_node):
                    rank = m * per_node + i
                    procs[rank] = _start(base, rank, world, n, node_ids[n], shm[n], attempt,
                                         common)
            if attempt == 0 and kill_node is not None:
                victim = procs[kill_node * per_node]
                while victim.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                r.t_lost = time.time()
                lost_ranks = {kill_node * per_node + i for i in range(per_node)}
                for rank_, p in procs.items():  # the job's other workers go down too
                    if p.poll() is None and (survivors == "kill" or rank_ in lost_ranks):
                        os.killpg(p.pid, signal.SIGKILL)
                while survivors == "wait" and time.monotonic() < deadline:
                    for rank_, p in procs.items():
                        if rank_ not in r.survivor_exit and rank_ not in lost_ranks \
                                and p.poll() is not None:
                            r.survivor_exit[rank_] = time.time() - r.t_lost
                    if all(p.poll() is not None for p in procs.values()):
                        break
                    time.sleep(0.01)
                r.rcs.append(_wait_all(procs, deadline))
                kill = r.out / "kill.json"
                r.kill = json.loads(kill.read_text()) if kill.exists() else None
                for n in (lose if lose is not None else (kill_node,)):
                    shutil.rmtree(shm[n], ignore_errors=True)  # the node's memory is gone
                    shm[n] = shm_root / f"shm-node{n}-new"
                    shm[n].mkdir(mode=0o700, exist_ok=True)
                    node_ids[n] = f"node{n}-new"
                if between is not None:  # e.g. the bench drops the page cache of the flush
                    between(r)
                continue
            r.rcs.append(_wait_all(procs, deadline))
    finally:
        for n, d in shm.items():
            r.left[n] = sorted(os.listdir(d)) if d.is_dir() else []
            shutil.rmtree(d, ignore_errors=True)
    for rank in range(world):
        f = r.out / f"rank-{rank}.json"
        if f.exists():
            r.ranks[rank] = json.loads(f.read_text())
    r.seconds = time.monotonic() - t0
    return r


def reference(base: Path, *, nodes: int = 2, per_node: int = 1, steps: int = 30,
              env: dict[str, str] | None = None) -> NodeRun:
    """The same job without cudasnap and without a failure."""
    e = {"NO_SNAP": "1", "CUDASNAP_NODE_REPLICA": "0"}
    e.update(env or {})
    return run(base, nodes=nodes, per_node=per_node, steps=steps, env=e)
