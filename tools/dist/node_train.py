"""Worker of the node-loss tests and bench (tools/dist/node_launch.py starts it; gloo on CPU).

One process per rank; "nodes" are told apart by CUDASNAP_NODE_ID and CUDASNAP_SHM_DIR.
Env:
  CKPT, OUT, STORE_DIR (one FileStore per attempt: STORE_DIR/store-<attempt>)
  ATTEMPT       the launch attempt (0 first); under torchrun (TORCHELASTIC_RUN_ID set) the
                attempt is 1 once OUT/kill.json exists and the FileStore is named by MASTER_PORT
  KILL_AGENT=1  the victim SIGKILLs its parent (its torchrun agent) before itself
  STEPS         steps to train (default 30)
  MODE          "ddp" (DDP, fixed bucket layout) or "fsdp" (FSDP2 fully_shard on a 1-D mesh)
  KILL_RANK, KILL_STEP   that rank SIGKILLs itself in the forward of that step (attempt 0)
  KILL_NODE_RANKS        the ranks of its node ("acked": the victim waits for all of them)
  KILL_WHEN     "acked": first wait until its replica of step KILL_STEP-1 is acknowledged
                (node_replica xor:K: its parity round of that step completed);
                "inflight": right after boundary KILL_STEP-1, wait until its replica is in
                flight and die 0.15 s into the transfer (cut in the middle); "now": no wait
  FLUSH_AT=S    every rank flushes after step S (attempt 0 only)
  NO_SNAP=1     no Snapshotter (the reference run)
  WIDTH, DEPTH  model size
  STEP_SLEEP    seconds slept after each step (default 0.01)
Writes OUT/rank-R.json (start, restore stats, replica stats, shared-memory bytes of its node,
times) and OUT/rank-R.npz (final state).
"""
import time

T_START = time.time()

import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cudasnap  # noqa: E402


class Data:
    """Per-rank batches from (rank, position): the state is the position alone."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next(self):
        g = torch.Generator().manual_seed(1000 + 7919 * self.rank + self.position)
        self.position += 1
        return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


def local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().copy()


def state_arrays(core, opt):
    arrays = {k: local(v) for k, v in core.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            arrays[f"opt.{i}.{k}"] = local(v) if torch.is_tensor(v) else np.asarray(v)
    return arrays


def shm_bytes(shm: str) -> dict:
    own = guest = parity = 0
    for name in os.listdir(shm) if os.path.isdir(shm) else []:
        if name.startswith("."):
            continue
        n = os.stat(os.path.join(shm, name)).st_blocks * 512
        if name.endswith(".xor"):  # cudasnap-<job>-x<set>-h<holder>-s<step>.xor
            parity += n
        elif not name.endswith(".arena"):
            continue
        elif name.rsplit("-", 1)[-1].startswith("g"):  # cudasnap-<job>-g<rank>.arena
            guest += n
        else:
            own += n
    return {"own": own, "guest": guest, "parity": parity}


def die(out: str, rank: int, step: int, replica: dict) -> None:
    with open(os.path.join(out, "kill.json.tmp"), "w") as f:
        json.dump({"rank": rank, "step": step, "t": time.time(), "replica": replica,
                   "node": os.environ.get("CUDASNAP_NODE_ID")}, f)
    os.replace(os.path.join(out, "kill.json.tmp"), os.path.join(out, "kill.json"))
    if os.environ.get("KILL_AGENT") == "1":  # torchrun: the node's agent goes first
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def wait_replica(snap, step: int, when: str) -> dict:
    rep = snap.dist.replica
    end = time.monotonic() + 120
    while time.monotonic() < end:
        s = rep.stats()
        if when == "acked" and s["sent_step"] is not None and s["sent_step"] >= step - 1:
            return s
        if when == "acked" and s.get("parity_step") is not None and s["parity_step"] >= step - 1:
            return s  # XOR parity: the round of the previous step completed on every member
        if when == "inflight" and s["sent_step"] is not None and s["in_flight_step"] == step - 1:
            time.sleep(0.15)  # a part of the transfer is on the wire
            return rep.stats()
        if when == "now":
            return s
        time.sleep(0.005)
    raise SystemExit(f"replica of step {step - 1} not {when} within 120 s: {rep.stats()}")


def main() -> int:
    torch.set_num_threads(1)
    out = os.environ["OUT"]
    os.makedirs(out, exist_ok=True)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun: restart counts are per agent
        attempt = int(os.path.exists(os.path.join(out, "kill.json")))
        store = f"store-{os.environ['MASTER_PORT']}"  # one rendezvous round: one port
    else:
        attempt = int(os.environ.get("ATTEMPT", "0"))
        store = f"store-{attempt}"
    dist.init_process_group("gloo", init_method=f"file://{os.environ['STORE_DIR']}/{store}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = os.environ.get("MODE", "ddp")
    torch.manual_seed(0)
    width, depth = int(os.environ.get("WIDTH", "64")), int(os.environ.get("DEPTH", "0"))
    hidden = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    core = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), *hidden,
                               torch.nn.Linear(width, 4))
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(core, bucket_cap_mb_list=[1e-6] * len(list(core.parameters())))
    elif mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in core:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        model = fully_shard(core, mesh=mesh)
    else:
        raise SystemExit(f"unknown MODE {mode!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Data(rank)
    steps = int(os.environ.get("STEPS", "30"))
    kill_rank, kill_step = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_STEP", "-1"))
    flush_at = int(os.environ.get("FLUSH_AT", "-1"))
    kill_when = os.environ.get("KILL_WHEN", "acked")
    kill_node = {int(x) for x in os.environ.get("KILL_NODE_RANKS", "").split(",") if x}
    snap, start, t0 = None, 0, time.time()
    if os.environ.get("NO_SNAP") != "1":
        snap = cudasnap.Snapshotter(model, opt, directory=os.environ["CKPT"], extra={"data": data},
                                    replicas=None)
        t0 = time.time()
        start = snap.restore_latest()
    t_restored = time.time()
    t_first = None
    for step in range(start, steps):
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == kill_step and rank in kill_node and attempt == 0 and kill_when == "acked":
            # every rank of the lost node has its replica of the previous step acknowledged
            wait_replica(snap, step, kill_when)
            open(os.path.join(out, f"acked-{rank}"), "w").close()
            while rank == kill_rank and not all(
                    os.path.exists(os.path.join(out, f"acked-{r}")) for r in kill_node):
                time.sleep(0.005)
        if step == kill_step and rank == kill_rank and attempt == 0 and kill_when != "inflight":
            die(out, rank, step, wait_replica(snap, step, kill_when))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if snap is not None:
            snap.boundary(step)
            if step == flush_at and attempt == 0:
                snap.flush()
            if step == kill_step - 1 and rank == kill_rank and attempt == 0 \
                    and kill_when == "inflight":
                die(out, rank, kill_step, wait_replica(snap, kill_step, kill_when))
        if t_first is None:
            t_first = time.time()
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.01")))
    info = {"rank": rank, "attempt": attempt, "start": start,
            "node": os.environ.get("CUDASNAP_NODE_ID"), "t_start": T_START, "t0": t0,
            "t_restored": t_restored, "t_first_step": t_first, "t_end": time.time(),
            "restore": snap.stats()["restore"] if snap else None,
            "shm": shm_bytes(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))}
    if snap is not None and snap.dist is not None and snap.dist.replica is not None:
        deadline = time.monotonic() + 60  # let the final step's replica land (bench figures)
        while snap.dist.replica.stats()["in_flight_step"] is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        info["replica"] = snap.dist.replica.stats()
        info["shm"] = shm_bytes(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
    np.savez(os.path.join(out, f"rank-{rank}.npz"), **state_arrays(core, opt))
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(info, f)
    if snap is not None:
        snap.flush()
        snap.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
