"""In-process multi-rank scenarios (torch.multiprocessing spawn + gloo on a FileStore).

Faster than torchrun; used by tests/distributed/test_distributed.py for the agreement,
commit and restore-validation logic. Each rank writes BASE/<scenario>-rank-R.json.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range,
           snap: Any) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snap.boundary(step)
    snap.wait()


def _pg(base: Path, name: str, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{base}/store-{name}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def _save(base: Path, rank: int, world: int, name: str, replicas: Any) -> dict[str, Any]:
    """Rank 1 is one step ahead; only rank 0 asks for a flush, rank 1 joins it."""
    import cudasnap

    _pg(base, name, rank, world)
    model, opt = _model()
    snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=f"{base.name}-{name}",
                                replicas=replicas, health=False)
    _train(model, opt, rank, range(6 + rank), snap)
    dist.barrier()
    res: dict[str, Any] = {"complete": snap.dist.complete_steps()}
    if rank == 0:
        t0 = time.perf_counter()
        res["path"] = str(snap.flush())
        res["flush_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        res["again"] = str(snap.flush())  # nothing newer: no second round
        res["again_s"] = time.perf_counter() - t0
    dist.barrier()  # rank 1's action thread joined the round meanwhile
    end = time.monotonic() + 20
    while snap.dist.last_flush is None and time.monotonic() < end:
        time.sleep(0.05)
    res["gen"] = snap.dist.gen
    res["last_flush"] = {k: str(v) for k, v in (snap.dist.last_flush or {}).items()}
    res["weights"] = model[0].weight.detach().flatten()[:8].tolist()
    snap.close()
    dist.barrier()
    dist.destroy_process_group()
    return res


def _restore(base: Path, rank: int, world: int, name: str, directory: Path,
             replicas: Any) -> dict[str, Any]:
    import cudasnap

    _pg(base, name, rank, world)
    model, opt = _model()
    snap = cudasnap.Snapshotter(model, opt, directory=directory, job=f"{base.name}-{name}",
                                replicas=replicas, health=False, distributed=True)
    res: dict[str, Any] = {}
    try:
        res["start"] = snap.restore_latest()
        res["restore"] = snap.stats()["restore"]
        res["weights"] = model[0].weight.detach().flatten()[:8].tolist()
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(e).__name__}: {e}"
    snap.close()
    dist.barrier()
    dist.destroy_process_group()
    return res


def _lost_memory(base: Path, rank: int, world: int, name: str) -> dict[str, Any]:
    """Both ranks reach step 3 in shared memory, nothing is flushed; rank 1's memory is lost
    (its arena removed, as with its node and its partner's copy). The restore must not start
    over silently: ERROR naming the step and the rank, SnapshotError with require_resume."""
    import logging

    import cudasnap

    _pg(base, name, rank, world)
    job = f"{base.name}-{name}"
    model, opt = _model()
    snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=job, health=False)
    _train(model, opt, rank, range(4), snap)
    arena = snap.arena_path
    snap.close(keep_arena=True)
    dist.barrier()
    if rank == 1:
        arena.unlink()
    dist.barrier()
    errors: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    handler = Keep()
    logging.getLogger("cudasnap").addHandler(handler)
    res: dict[str, Any] = {}
    try:
        model, opt = _model()
        snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=job, health=False)
        res["start"] = snap.restore_latest()
        snap.close(keep_arena=True)
        dist.barrier()
        model, opt = _model()
        snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=job, health=False,
                                    require_resume=True)
        try:
            res["strict"] = snap.restore_latest()
        except cudasnap.SnapshotError as e:
            res["strict_error"] = str(e)
        snap.close()
    finally:
        logging.getLogger("cudasnap").removeHandler(handler)
    res["errors"] = errors
    dist.barrier()
    dist.destroy_process_group()
    return res


def _restored_older(base: Path, rank: int, world: int, name: str) -> dict[str, Any]:
    """Step 1 committed, both ranks reach step 3 in shared memory; rank 1's memory is lost.
    The vote restores step 1 from disk; rank 0's arena still held steps 2 and 3 of the run
    before: emptied, so a flush of the re-run's step 2 or 3 never takes them."""
    import cudasnap

    _pg(base, name, rank, world)
    job = f"{base.name}-{name}"
    model, opt = _model()
    snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=job, health=False)
    _train(model, opt, rank, range(2), snap)
    snap.flush()
    _train(model, opt, rank, range(2, 4), snap)
    arena = snap.arena_path
    snap.close(keep_arena=True, flush=False)
    dist.barrier()
    if rank == 1:
        arena.unlink()
    dist.barrier()
    model, opt = _model()
    snap = cudasnap.Snapshotter(model, opt, directory=base / name, job=job, health=False)
    res: dict[str, Any] = {"start": snap.restore_latest()}
    arenas = snap.dist.local.arenas() if snap.dist is not None else []
    res["arena_steps"] = sorted(int(a.slot_info(i)["step"]) for a in arenas
                                for i in range(a.num_slots) if a.slot_info(i)["valid"])
    snap.close(flush=False)
    dist.barrier()
    dist.destroy_process_group()
    return res


def _latest_locked(base: Path, rank: int, world: int, name: str) -> dict[str, Any]:
    """Another writer holds ``latest``'s lock (a process, for 60 s) while every rank
    flushes with ``timeout=3``: the round still commits, and returns in time."""
    import subprocess
    import sys

    import cudasnap

    _pg(base, name, rank, world)
    model, opt = _model()
    d = base / name
    snap = cudasnap.Snapshotter(model, opt, directory=d, job=f"{base.name}-{name}", health=False)
    _train(model, opt, rank, range(4), snap)
    holder = None
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"),
            str(d / ".latest-lock")], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    dist.barrier()
    t0 = time.monotonic()
    path = snap.flush(timeout=3.0)
    res: dict[str, Any] = {"seconds": time.monotonic() - t0, "path": str(path),
                           "committed": (d / "step-00000003" / "COMMIT").is_file()}
    if holder is not None:
        holder.kill()
        holder.wait()
    dist.barrier()
    snap.close()
    dist.destroy_process_group()
    return res


def worker(rank: int, world: int, base_s: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.pop("CUDASNAP_HEALTH", None)
    base = Path(base_s)
    for sc in scenarios:
        try:
            if sc == "save_sharded":
                res = _save(base, rank, world, sc, None)
            elif sc == "save_replicated":
                res = _save(base, rank, world, sc, "all")
            elif sc == "missing_shard":
                if rank == 0:  # a copy for the world-size test, then lose rank 1's files
                    shutil.copytree(base / "save_sharded", base / "sharded_copy")
                    shutil.rmtree(base / "save_sharded" / "step-00000005" / "rank-00001")
                res = _restore(base, rank, world, sc, base / "save_sharded", None)
            elif sc == "world1_sharded":  # also run in the test process (world 1)
                res = _restore(base, rank, world, sc, base / "sharded_copy", None)
            elif sc == "lost_memory":
                res = _lost_memory(base, rank, world, sc)
            elif sc == "restored_older":
                res = _restored_older(base, rank, world, sc)
            elif sc == "latest_locked":
                res = _latest_locked(base, rank, world, sc)
            elif sc == "world1_replicated":
                res = _restore(base, rank, world, sc, base / "save_replicated", "all")
            else:
                raise ValueError(sc)
        except Exception:  # noqa: BLE001
            res = {"crash": traceback.format_exc()}
        (base / f"{sc}-rank-{rank}.json").write_text(json.dumps(res))
