"""Two torchrun agents as two "nodes" on this host, and the loss of one (issue 25 item 5).

The rendezvous store runs as a process of its own (a TCPStore master kept alive), so the
loss of either agent is survivable; each agent runs ``torchrun --nnodes 2 --rdzv-backend
c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf is_host=false`` with its own loopback
address, CUDASNAP_NODE_ID and CUDASNAP_SHM_DIR, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(else a replacement node never joins: /work/shared/DESIGN.md, "Node loss"). The workers are
tools/dist/node_train.py. The victim rank SIGKILLs its agent, then itself (one rank per
node: the whole node); the lost node's shared memory is removed and a replacement agent
(new node id, new empty shared memory, the same address) joins; the survivor's agent
restarts its worker, and the job resumes.
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
from pathlib import Path

from node_launch import REPO, WORKER, NodeRun


def _store() -> tuple[subprocess.Popen, int]:
    code = ("import sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\n"
            "sys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _agent(base: Path, node: int, node_id: str, shm: Path, port: int, env: dict[str, str],
           tag: str) -> subprocess.Popen:
    e = dict(os.environ)
    e.update({"CUDASNAP_NODE_ID": node_id, "CUDASNAP_SHM_DIR": str(shm),
              "CUDASNAP_REPLICA_ADDR": f"127.0.0.{10 + node}", "PYTHONPATH": str(REPO),
              "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDASNAP_HEALTH": "0",
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    e.update(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-conf=is_host=false", f"--rdzv-id={env['CUDASNAP_JOB']}",
           f"--local-addr=127.0.0.{10 + node}", "--max-restarts=3", "--monitor-interval=0.1",
           str(WORKER)]
    logf = open(base / "logs" / f"agent-{tag}.log", "w")  # noqa: SIM115 - closed by the OS
    return subprocess.Popen(cmd, env=e, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run(base: Path, *, steps: int = 16, kill_step: int = 10, env: dict[str, str] | None = None,
        timeout: float = 300.0) -> NodeRun:
    """Node 1 lost at ``kill_step`` (after its replica of the step before is acknowledged),
    replaced; both agents run to the end."""
    t0 = time.monotonic()
    for d in ("out", "ckpt", "store", "logs"):
        (base / d).mkdir(parents=True, exist_ok=True)
    job = f"tr-{uuid.uuid4().hex[:10]}"
    r = NodeRun(base=base, job=job)
    common = {"CKPT": str(r.ckpt), "OUT": str(r.out), "STORE_DIR": str(base / "store"),
              "CUDASNAP_JOB": job, "STEPS": str(steps), "CUDASNAP_NODE_REPLICA": "1",
              "KILL_STEP": str(kill_step), "KILL_WHEN": "acked", "KILL_AGENT": "1"}
    common.update(env or {})
    shm = {n: base / f"shm-node{n}" for n in (0, 1)}
    for d in shm.values():
        d.mkdir(mode=0o700)
    store, port = _store()
    agents: dict[str, subprocess.Popen] = {}
    deadline = time.monotonic() + timeout
    try:
        for n in (0, 1):
            # rank 1 (the second node of the first round) is the victim; after the
            # restart the ranks may be renumbered, which the restore handles
            agents[f"node{n}"] = _agent(base, n, f"node{n}", shm[n], port,
                                        {**common, "KILL_RANK": "1", "KILL_NODE_RANKS": "1"},
                                        f"node{n}")
        kill = r.out / "kill.json"
        while not kill.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        r.kill = json.loads(kill.read_text()) if kill.exists() else None
        lost = 1 if r.kill is None or r.kill.get("node") == "node1" else 0
        victim = agents[f"node{lost}"]
        while victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        r.t_lost = time.time()
        shutil.rmtree(shm[lost], ignore_errors=True)  # the node's memory is gone
        shm[lost] = base / f"shm-node{lost}-new"
        shm[lost].mkdir(mode=0o700)
        agents[f"node{lost}-new"] = _agent(base, lost, f"node{lost}-new", shm[lost], port,
                                           {**common, "KILL_RANK": "-1"}, f"node{lost}-new")
        rcs: dict[int, int | None] = {}
        for i, (name, a) in enumerate(agents.items()):
            if name == f"node{lost}":
                continue
            try:
                rcs[i] = a.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                rcs[i] = None
        r.rcs.append(rcs)
    finally:
        for a in agents.values():
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        store.kill()
        store.wait()
        for d in shm.values():
            shutil.rmtree(d, ignore_errors=True)
    for rank in (0, 1):
        f = r.out / f"rank-{rank}.json"
        if f.exists():
            r.ranks[rank] = json.loads(f.read_text())
    r.seconds = time.monotonic() - t0
    return r
