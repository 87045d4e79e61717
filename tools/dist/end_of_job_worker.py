"""The end of a multi-rank job with one rank late to its last boundary (issue 23 item 1).

Run under torchrun (gloo on CPU) by tests/distributed/test_end_of_job.py, directly or inside
``cudasnap run``. Every rank trains STEPS steps, then does what the README asks at the
end of a multi-rank job: ``snap.flush()`` on every rank, then ``snap.close()``.

SCENARIO "late" (the default): LATE_RANK reaches its last ``boundary()`` late,
deterministically: only once the flush round the other ranks opened has its part
published (its peer monitor joins the round, and the steps COMPLETE here, without the
last one, are in the store), then LATE_S seconds more. After its own flush it closes
only once every other rank's process is gone, plus CLOSE_AFTER_S: its peer monitor has
every chance to take their clean end for a failure.
SCENARIO "stuck": LATE_RANK trains the last step but never calls its ``boundary()``; it
flushes once the others' round is open and closes first (the explicit round's wait
for it must end at its bound). SCENARIO "dead": LATE_RANK SIGKILLs itself after the
last step's training, before its boundary (no explicit round waits for a dead rank).

Env:
  CKPT           snapshot directory (default: CUDASNAP_DIR, as ``cudasnap run`` sets it)
  OUT            results: rank-R.json; STORE_DIR: the FileStores of the process group
  STEPS (6), MODE ("plain": the model on every rank, gradients all-reduced by hand;
  "fsdp": FSDP2 fully_shard on a 1-D mesh), SCENARIO, LATE_RANK (1), LATE_S (0.5),
  CLOSE_AFTER_S (1.5), SNAPSHOT_EVERY (1: the Snapshotter's snapshot_every), GATE (1;
  0: "late" is LATE_S of sleep alone, for timings sampled at random, e.g. a fault matrix)
OUT/rank-R.json: attempt (torchrun's restart count), restart (``cudasnap run``'s),
start, gate (what the late rank saw in the store), flush_s, flush_path, close_s.
"""
import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cudasnap  # noqa: E402


def build(mode: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 13), torch.nn.Tanh(), torch.nn.Linear(13, 4))
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for i in (0, 2):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode != "plain":
        raise SystemExit(f"unknown MODE {mode!r}")
    return model


def pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[:1]
    except FileNotFoundError:
        return True
    return bool(state) and state[0] in ("Z", "X")


def wait_key(snap, key: str, timeout: float = 30.0):
    """The value of the coordinator's store key ``key`` once set (None after ``timeout``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = snap.dist.kv.get(key)
        if v is not None:
            return v
        time.sleep(0.01)
    return None


def main() -> int:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restart = int(os.environ.get("CUDASNAP_RESTART", "0"))
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    # One FileStore per attempt of torchrun and of cudasnap run (a restarted torchrun
    # counts from 0 again).
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['STORE_DIR']}/store-{restart}-{attempt}",
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    mode = os.environ.get("MODE", "plain")
    model = build(mode, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = int(os.environ.get("STEPS", "6"))
    late_rank = int(os.environ.get("LATE_RANK", "1"))
    late_s = float(os.environ.get("LATE_S", "0.5"))
    scenario = os.environ.get("SCENARIO", "late")
    snap = cudasnap.Snapshotter(model, opt, directory=os.environ.get("CKPT") or None,
                                snapshot_every=int(os.environ.get("SNAPSHOT_EVERY", "1")))
    start = snap.restore_latest()
    info: dict = {"rank": rank, "attempt": attempt, "restart": restart, "start": start}
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 + 7919 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if mode == "plain":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        late = step == steps - 1 and rank == late_rank and snap.dist is not None
        if late and scenario == "dead":
            (out / "kill.json").write_text(json.dumps({"rank": rank, "step": step,
                                                       "t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        if late and scenario == "late":
            # The gate: the others' flush round is open and this rank's part of it has
            # published its COMPLETE steps (its monitor joined), the last one not among them.
            if os.environ.get("GATE", "1") == "1":
                info["gate"] = {"key": f"flush/{snap.dist.gen}/have/{rank}",
                                "have": wait_key(snap, f"flush/{snap.dist.gen}/have/{rank}")}
            time.sleep(late_s)
        if not (late and scenario == "stuck"):
            snap.boundary(step)
    if rank == late_rank and scenario == "stuck":
        info["gate"] = {"request": wait_key(snap, f"flush/{snap.dist.gen}/request")}
    t0 = time.perf_counter()
    path = snap.flush()
    info["flush_s"] = time.perf_counter() - t0
    info["flush_path"] = str(path) if path is not None else None
    # "late": the late rank closes last, once the others exited; "stuck": first.
    wait_for = [r for r in range(world) if r != rank] if rank == late_rank else []
    if scenario == "stuck":
        wait_for = [] if rank == late_rank else [late_rank]
    end = time.monotonic() + 30
    for r in wait_for:
        while time.monotonic() < end and not pid_gone(int((out / f"pid-{r}").read_text())):
            time.sleep(0.05)
    if wait_for:
        time.sleep(float(os.environ.get("CLOSE_AFTER_S", "1.5")))
    t0 = time.perf_counter()
    snap.close()
    info["close_s"] = time.perf_counter() - t0
    info["t_end"] = time.time()
    (out / f"rank-{rank}.json").write_text(json.dumps(info))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
