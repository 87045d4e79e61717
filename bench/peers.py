"""cudasnap next to its peers on the same state (issue 6).

Cases: each size in ``--sizes`` with few big tensors (2 params + AdamW: 8
tensors), and one many-small-tensors case (``--many-size`` GB in
``--many-tensors`` tensors). Every peer group runs in its own subprocess per
case (a broken peer cannot take the others down; memory starts clean), builds
the same state, and measures in that process a raw ``os.write`` + fsync of the
same bytes as its disk baseline. Peers:

* torch.save + fsync / torch.load (+ copy into the live tensors);
* torch.distributed.checkpoint: ``save``, ``async_save`` (default staging) and
  ``async_save`` with ``DefaultStager`` (async staging into shared memory; pinned
  memory needs CUDA) / ``dcp.load`` in place; single-rank gloo on a FileStore;
* torchsnapshot 0.1.0: ``Snapshot.take`` / ``async_take`` (+ fsync of its files,
  which it does not do) / ``restore``;
* DLRover Flash Checkpoint 0.6.1 ``DdpCheckpointer`` without ``dlrover-run`` (it
  starts its own saver process): save to memory, save to disk (durable when its
  tracker file names the step and the data file is fsync'd), load from memory;
* Meta's torch-checkpointing 0.1.1: ``CheckpointManager`` async save (staging
  into shared memory, background writer process; + fsync of its files) / ``load``;
* Hugging Face Transformers ``enable_jit_checkpoint`` (bench/hf_jit_peer.py): the
  Trainer's SIGTERM-time checkpoint of the same state, CPU;
* cudasnap: ``boundary()`` blocked, time to COMPLETE, JIT ``flush()`` to durable,
  ``restore_latest()`` from shared memory and from disk.

Peak extra host memory: VmHWM of the peer's process during the phase (reset
through /proc/self/clear_refs) minus its RSS before; a sampler thread where the
reset is refused. Helper processes (DLRover's saver) are not included.

    make bench-deps   # torchsnapshot and DLRover (not installed by make test)
    python bench/peers.py [--sizes 1,4] [--repeats 3] [--quick] [--json] [--png bench/peers.png]
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# Every boundary copies (what these figures measure): the default overhead budget would
# skip boundaries once it has measured the cost (cudasnap.core.cadence). Old trees ignore it.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")

# `make bench-deps` installs torchsnapshot and DLRover here, outside the venv.
PEERS_DIR = Path(__file__).resolve().parents[1] / "build" / "bench-peers"
if PEERS_DIR.is_dir():
    sys.path.append(str(PEERS_DIR))

GROUPS = ["cudasnap", "torch", "dcp", "torchsnapshot", "dlrover", "torchckpt", "hf_jit"]
PNG = Path(__file__).resolve().parent / "peers.png"


# =================================================================== child side
class Ctx:
    def __init__(self, a: Any) -> None:
        import torch  # noqa: F401

        self.a = a
        self.tmp = Path(a.dir)
        self.n_params = max(1, a.tensors // 4)
        self.model, self.opt = C.build_state(a.size, self.n_params)
        self.flat = C.flat_state(self.model, self.opt)
        self.nbytes = C.state_bytes(self.flat)
        self.raw: list[float] = []
        self.out: dict[str, dict[str, Any]] = {}
        C.free_mem()
        self.base_rss = C.rss_bytes()  # after the state is built, before any peer work

    def raw_write(self) -> float:
        """os.write of every tensor's bytes into one file + fsync (the disk baseline)."""
        path = self.tmp / "raw.bin"
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for t in self.flat.values():
                mv = memoryview(t.detach().numpy()).cast("B") if t.dim() else \
                    memoryview(t.detach().reshape(1).numpy()).cast("B")
                off = 0
                while off < len(mv):
                    off += os.write(fd, mv[off:off + (1 << 30)])
            os.fsync(fd)
        finally:
            os.close(fd)
        dt = time.perf_counter() - t0
        C.drop_cache(path)
        C.rm(path)
        return dt

    def rec(self, peer: str, **kw: Any) -> None:
        d = self.out.setdefault(peer, {})
        for k, v in kw.items():
            d.setdefault(k, []).append(v)

    def measure(self, peer: str, save: Callable[[int], dict[str, float]],
                restore: Callable[[int], dict[str, float]] | None, cleanup: Callable[[], None]) -> None:
        for r in range(self.a.repeats):
            self.raw.append(self.raw_write())
            C.free_mem()
            with C.PeakRss() as pk:
                res = save(r)
            C.free_mem()
            self.rec(peer, save_peak=pk.extra, rss_method=pk.method,
                     held=max(0, C.rss_bytes() - self.base_rss), **res)
            if restore is not None:
                C.free_mem()
                with C.PeakRss() as pk:
                    rres = restore(r)
                self.rec(peer, restore_peak=pk.extra, **rres)
            cleanup()
            C.free_mem()
            C.log(f"    {peer} repeat {r}: {res} {rres if restore else ''}")


def g_torch(cx: Ctx) -> None:
    import snapshot_cpu as S

    path = cx.tmp / "torch.pt"

    def save(_r: int) -> dict[str, float]:
        C.rm(path)
        dt = S.torch_save(cx.model, cx.opt, path)
        return {"blocked": dt, "durable": dt}

    def restore(_r: int) -> dict[str, float]:
        return {"restore_disk": S.torch_restore(cx.model, cx.opt, path)}

    cx.measure("torch.save", save, restore, lambda: C.rm(path))


def g_dcp(cx: Ctx) -> None:
    import torch.distributed.checkpoint as dcp

    C.init_dist(cx.tmp)
    path = cx.tmp / "dcp"

    def save(_r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        dcp.save(cx.flat, checkpoint_id=str(path))
        C.fsync_dir(path)
        dt = time.perf_counter() - t0
        return {"blocked": dt, "durable": dt}

    def restore(_r: int) -> dict[str, float]:
        C.drop_cache(path)
        t0 = time.perf_counter()
        dcp.load(cx.flat, checkpoint_id=str(path))
        return {"restore_disk": time.perf_counter() - t0}

    cx.measure("dcp.save", save, restore, lambda: C.rm(path))

    def asave(_r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        fut = dcp.async_save(cx.flat, checkpoint_id=str(path))
        blocked = time.perf_counter() - t0
        getattr(fut, "upload_completion", fut).result()
        C.fsync_dir(path)
        return {"blocked": blocked, "durable": time.perf_counter() - t0}

    cx.measure("dcp.async_save", asave, None, lambda: C.rm(path))

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        cx.out["dcp.async_save+stager"] = {"error": f"no DefaultStager in this torch: {e}"}
        return
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                          use_async_staging=True, use_non_blocking_copy=False))

    def ssave(_r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        resp = dcp.async_save(cx.flat, checkpoint_id=str(path), async_stager=stager)
        blocked = time.perf_counter() - t0
        staged = None
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
            staged = time.perf_counter() - t0
        getattr(resp, "upload_completion", resp).result()
        C.fsync_dir(path)
        return {"blocked": blocked, "in_memory": staged, "durable": time.perf_counter() - t0}

    try:
        cx.measure("dcp.async_save+stager", ssave, None, lambda: C.rm(path))
    finally:
        stager.close()


def g_torchsnapshot(cx: Ctx) -> None:
    try:
        import torchsnapshot
    except Exception as e:  # not installed / broken with this torch
        for p in ("torchsnapshot.take", "torchsnapshot.async_take"):
            cx.out[p] = {"error": f"import torchsnapshot failed: {type(e).__name__}: {e}"}
        return
    sd = torchsnapshot.StateDict(**cx.flat)
    app = {"state": sd}
    path = cx.tmp / "ts"

    def save(_r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        torchsnapshot.Snapshot.take(path=str(path), app_state=app)
        blocked = time.perf_counter() - t0
        C.fsync_tree(path)  # torchsnapshot writes without fsync
        return {"blocked": blocked, "durable": time.perf_counter() - t0}

    def restore(_r: int) -> dict[str, float]:
        C.drop_cache(path)
        t0 = time.perf_counter()
        torchsnapshot.Snapshot(path=str(path)).restore(app_state=app)
        moved = [k for k, t in cx.flat.items() if sd[k] is not t]
        if moved:
            C.copy_into(cx.flat, sd)
        return {"restore_disk": time.perf_counter() - t0}

    cx.measure("torchsnapshot.take", save, restore, lambda: C.rm(path))

    def asave(_r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        pending = torchsnapshot.Snapshot.async_take(path=str(path), app_state=app)
        blocked = time.perf_counter() - t0
        pending.wait()
        C.fsync_tree(path)
        return {"blocked": blocked, "durable": time.perf_counter() - t0}

    cx.measure("torchsnapshot.async_take", asave, None, lambda: C.rm(path))


def g_dlrover(cx: Ctx) -> None:
    import torch

    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    try:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    except Exception as e:
        for p in ("dlrover.memory", "dlrover.disk"):
            cx.out[p] = {"error": f"import dlrover failed: {type(e).__name__}: {e}"}
        return
    C.init_dist(cx.tmp)
    ckdir = cx.tmp / "dlrover"
    t0 = time.perf_counter()
    ck = DdpCheckpointer(str(ckdir))
    init_s = time.perf_counter() - t0
    tracker = ckdir / "dlrover_latest.txt"
    step = [0]

    def msave(_r: int) -> dict[str, float]:
        step[0] += 1
        t0 = time.perf_counter()
        ok = ck.save_checkpoint(step[0], cx.flat, str(ckdir / f"ckpt-{step[0]}.pt"),
                                storage_type=StorageType.MEMORY)
        dt = time.perf_counter() - t0
        if ok is False:
            raise RuntimeError("DLRover skipped the memory save (shared memory busy)")
        return {"blocked": dt, "in_memory": dt}

    def mrestore(_r: int) -> dict[str, float]:
        t0 = time.perf_counter()
        sd = ck.load_checkpoint()
        if not sd:
            raise RuntimeError("DLRover load_checkpoint() returned nothing")
        C.copy_into(cx.flat, sd)
        return {"restore_shm": time.perf_counter() - t0}

    cx.measure("dlrover.memory", msave, mrestore, lambda: None)

    def dsave(_r: int) -> dict[str, float]:
        step[0] += 1
        path = ckdir / f"ckpt-{step[0]}.pt"
        t0 = time.perf_counter()
        ck.save_checkpoint(step[0], cx.flat, str(path), storage_type=StorageType.DISK)
        blocked = time.perf_counter() - t0
        t_end = time.time() + 600
        while time.time() < t_end:  # the saver process commits by writing the tracker file
            try:
                if tracker.read_text().strip() == str(step[0]) and path.exists():
                    break
            except OSError:
                pass
            time.sleep(0.002)
        else:
            raise TimeoutError("DLRover never committed the disk checkpoint")
        C.fsync_file(path)  # DLRover's torch.save of the data file is not fsync'd
        C.fsync_dir(ckdir)
        return {"blocked": blocked, "durable": time.perf_counter() - t0}

    def drestore(_r: int) -> dict[str, float]:
        path = ckdir / f"ckpt-{step[0]}.pt"
        C.drop_cache(path)
        t0 = time.perf_counter()
        sd = torch.load(path, weights_only=True)
        C.copy_into(cx.flat, sd)
        return {"restore_disk": time.perf_counter() - t0}

    def dclean() -> None:
        for p in ckdir.glob("ckpt-*.pt"):
            C.rm(p)

    cx.measure("dlrover.disk", dsave, drestore, dclean)
    cx.out.setdefault("dlrover.memory", {})["init_s"] = [init_s]
    try:
        ck.close() if hasattr(ck, "close") else None
    except Exception:
        pass


def g_torchckpt(cx: Ctx) -> None:
    """Meta's torch-checkpointing: ``CheckpointManager`` with its default async saver
    (staging into shared memory on a thread pool, a background writer process)."""
    try:
        from torch_checkpointing import CheckpointManager
    except Exception as e:
        cx.out["torch-checkpointing"] = {
            "error": f"import torch_checkpointing failed: {type(e).__name__}: {e}"}
        return
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    # Its default O_DIRECT writes (torch.save's unaligned records) fail with EINVAL on
    # ext4 here (0.1.1 falls back only when open() refuses O_DIRECT): buffered I/O.
    t0 = time.perf_counter()
    mgr = CheckpointManager(CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
    init_s = time.perf_counter() - t0
    step = [0]

    def path(k: int) -> Path:
        return cx.tmp / "tc" / f"step_{k}"

    def save(_r: int) -> dict[str, float]:
        step[0] += 1
        p = path(step[0])
        t0 = time.perf_counter()
        fut = mgr.save(str(p), {"state": cx.flat})
        blocked = time.perf_counter() - t0
        staged = None
        sf = getattr(mgr, "_staging_future", None)
        if sf is not None:
            sf.result()
            staged = time.perf_counter() - t0
        if fut is not None:
            fut.result()
        C.fsync_tree(p)  # its writer process does not fsync
        return {"blocked": blocked, "in_memory": staged, "durable": time.perf_counter() - t0}

    def restore(_r: int) -> dict[str, float]:
        p = path(step[0])
        for f in p.rglob("*"):
            if f.is_file():
                C.drop_cache(f)
        t0 = time.perf_counter()
        got = mgr.load(str(p), into={"state": cx.flat})
        state = got.get("state", {})
        moved = [k for k, t in cx.flat.items() if state.get(k) is not t]
        if moved:
            C.copy_into(cx.flat, state)
        return {"restore_disk": time.perf_counter() - t0}

    try:
        # The first save starts its writer process (spawn + imports): timed apart,
        # as cudasnap's arena set-up is, then the repeats measure steady saves.
        first = save(-1)
        C.rm(path(step[0]))
        cx.measure("torch-checkpointing", save, restore, lambda: C.rm(path(step[0])))
        cx.out["torch-checkpointing"].update(init_s=[init_s], first_save_blocked=[first["blocked"]])
    finally:
        mgr.close()


def g_hf_jit(cx: Ctx) -> None:
    """Transformers' ``enable_jit_checkpoint``: on SIGTERM the Trainer saves a full
    checkpoint (``_save_checkpoint``: model + optimizer + scheduler + RNG) from the
    live state; training is stopped meanwhile (blocked == durable)."""
    from hf_jit_peer import hf_jit_peer

    hf_jit_peer(cx)


def g_cudasnap(cx: Ctx) -> None:
    import cudasnap

    snapdir = cx.tmp / "cudasnap"
    job = f"peers-{os.getpid()}"
    mk = lambda: cudasnap.Snapshotter(cx.model, cx.opt, directory=snapdir, job=job,  # noqa: E731
                                      keep=1, health=False)
    box = {"snap": mk(), "step": 0}
    box["snap"].arena_ready()  # made in the background since construction (snapshot_cpu.py --first-boundary)
    t0 = time.perf_counter()
    box["snap"].boundary(0)
    first = time.perf_counter() - t0
    box["snap"].wait()
    setup = box["snap"].stats().get("arena_setup_seconds")

    def save(_r: int) -> dict[str, float]:
        s = box["snap"]
        extra = {}
        if box.get("fresh"):  # a new Snapshotter (after the restore cycle) rebuilds its layout
            box["step"] += 1
            cx.opt.step()
            t0 = time.perf_counter()
            s.boundary(box["step"])
            extra["rebuild_blocked"] = time.perf_counter() - t0
            s.wait()
            box["fresh"] = False
        box["step"] += 1
        cx.opt.step()
        t0 = time.perf_counter()
        s.boundary(box["step"])
        blocked = time.perf_counter() - t0
        s.wait()
        complete = time.perf_counter() - t0
        t1 = time.perf_counter()
        path = s.flush()
        flush = time.perf_counter() - t1
        C.drop_cache(path)
        return {"blocked": blocked, "in_memory": complete, "flush": flush,
                "durable": complete + flush, **extra}

    def restore(_r: int) -> dict[str, float]:
        s = box["snap"]
        s.close(keep_arena=True)
        s = mk()
        t0 = time.perf_counter()
        s.restore_latest()
        shm = time.perf_counter() - t0
        assert (s.stats()["restore"] or {}).get("source") == "shm"
        s.close(keep_arena=True)
        ap = Path(s.arena_path)
        away = ap.with_name(ap.name + ".away")
        os.rename(ap, away)
        try:
            C.free_mem()
            s2 = mk()
            t0 = time.perf_counter()
            s2.restore_latest()
            disk = time.perf_counter() - t0
            assert (s2.stats()["restore"] or {}).get("source") == "disk"
            s2.close()
        finally:
            os.rename(away, ap)
        box["snap"] = mk()
        box["fresh"] = True
        return {"restore_shm": shm, "restore_disk": disk}

    try:
        cx.measure("cudasnap", save, restore, lambda: None)
    finally:
        box["snap"].close()
    cx.out["cudasnap"]["first_boundary_s"] = [first]
    cx.out["cudasnap"]["arena_setup_s"] = [setup]


def child_main(a: Any) -> int:
    cx = Ctx(a)
    C.log(f"  [{a.group}] {cx.nbytes / C.GB:.2f} GB in {len(cx.flat)} tensors")
    try:
        {"torch": g_torch, "dcp": g_dcp, "torchsnapshot": g_torchsnapshot, "dlrover": g_dlrover,
         "cudasnap": g_cudasnap, "torchckpt": g_torchckpt, "hf_jit": g_hf_jit}[a.group](cx)
    except Exception as e:
        import traceback

        traceback.print_exc()
        cx.out.setdefault(f"{a.group}", {})["error"] = f"{type(e).__name__}: {e}"
    with open(a.result, "w") as f:
        json.dump({"group": a.group, "bytes": cx.nbytes, "tensors": len(cx.flat),
                   "raw": cx.raw, "peers": cx.out}, f)
    import multiprocessing

    for ch in multiprocessing.active_children():  # DLRover's saver process
        ch.terminate()
        ch.join(5)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)  # DLRover's saver / thread pools must not keep the process alive


# =================================================================== parent side
def run_group(group: str, size: float, tensors: int, a: Any, tmp: Path) -> dict[str, Any]:
    d = tmp / f"{group}-{size:g}-{tensors}"
    d.mkdir()
    shm_before = set(os.listdir("/dev/shm"))
    result = d / "result.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", group, "--size", str(size),
           "--tensors", str(tensors), "--repeats", str(a.repeats), "--dir", str(d),
           "--result", str(result)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    t0 = time.time()
    # own session: whatever the peer forks (DLRover's saver) is killed with it afterwards
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    err = None
    try:
        p.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        err = f"timed out after {a.timeout:.0f} s"
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    res: dict[str, Any] = {"group": group, "error": err or f"no result (rc={p.returncode})"}
    if result.exists():
        res = json.loads(result.read_text())
    res["wall_s"] = time.time() - t0
    # what this peer's process left in /dev/shm (only names it owns)
    mine = ("ckpt_shm_", f"cudasnap-peers-{p.pid}-", f"torch_{p.pid}_")
    for name in set(os.listdir("/dev/shm")) - shm_before:
        if name.startswith(mine):
            C.rm(Path("/dev/shm") / name)
    C.rm(d)
    return res


def summarize(case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """peer -> medians (seconds, bytes) for one case."""
    m = C.med
    rows: dict[str, dict[str, Any]] = {}
    for g in case["groups"]:
        raw = m(g.get("raw", []))
        if "peers" not in g:
            rows[g["group"]] = {"error": g.get("error"), "raw": raw}
            continue
        for peer, d in g["peers"].items():
            if not isinstance(d, dict) or "error" in d and len(d) == 1:
                rows[peer] = {"error": (d or {}).get("error") if isinstance(d, dict) else str(d),
                              "raw": raw}
                continue
            r = {k: m(v) for k, v in d.items()
                 if isinstance(v, list) and v and all(isinstance(x, (int, float)) or x is None
                                                       for x in v)}
            r["raw"] = raw
            if "error" in d:
                r["error"] = d["error"]
            rows[peer] = r
    return rows


def report(cases: list[dict[str, Any]]) -> str:
    f = C.fmt
    out = []
    order = ["cudasnap", "torch.save", "dcp.save", "dcp.async_save", "dcp.async_save+stager",
             "torchsnapshot.take", "torchsnapshot.async_take", "dlrover.memory", "dlrover.disk",
             "torch-checkpointing", "hf enable_jit_checkpoint"]
    for case in cases:
        rows_d = summarize(case)
        cs = rows_d.get("cudasnap", {})
        gb = case["bytes"] / C.GB
        rows = []
        for peer in order + sorted(set(rows_d) - set(order)):
            if peer not in rows_d:
                continue
            r = rows_d[peer]
            if r.get("blocked") is None and r.get("error"):
                rows.append([peer, "n/a: " + str(r["error"])[:90]] + ["-"] * 11)
                continue
            mem = r.get("save_peak")
            rows.append([
                peer, f(r.get("blocked"), " s"), f(C.ratio(r.get("blocked"), cs.get("blocked")), "x"),
                f(r.get("in_memory"), " s"), f(r.get("durable"), " s"),
                f(C.ratio(r.get("durable"), cs.get("flush")), "x"),
                f(C.ratio(r.get("raw"), r.get("durable")), "x"),
                f(r.get("restore_shm"), " s"), f(r.get("restore_disk"), " s"),
                f(C.ratio(r.get("restore_disk"), cs.get("restore_disk")), "x"),
                f(mem / C.GB if mem is not None else None, " GB"),
                f(r["held"] / C.GB if r.get("held") is not None else None, " GB"),
                f((r.get("restore_peak") or 0) / C.GB if r.get("restore_peak") is not None else None,
                  " GB")])
        title = (f"{case['label']}: {gb:.2f} GB in {case['tensors']} tensors "
                 f"(median of {case['repeats']})")
        out.append(C.print_table(
            title,
            ["peer", "blocked", "blocked / cudasnap", "in memory (COMPLETE)", "durable",
             "durable / cudasnap flush", "raw write / durable", "restore from memory",
             "restore from disk", "restore disk / cudasnap", "peak extra RSS (save)",
             "RSS held after save", "peak extra RSS (restore)"], rows,
            "blocked: time the training thread is held in the call. durable: from the call to "
            "fsync'd files (cudasnap: boundary -> COMPLETE + flush(); its JIT flush alone is the "
            "`flush` figure the ratio column uses). raw write = os.write+fsync of the same bytes "
            "in the same process. RSS includes mapped shared memory (cudasnap's 3-slot arena, "
            "DLRover's buffer); 'held' = RSS after the save minus RSS before the peer's first "
            "save (staging kept between saves)."))
        fl = cs.get("flush")
        out.append(f"cudasnap {case['label']}: boundary blocked {f(cs.get('blocked'), ' s')} "
                   f"(first boundary of a new Snapshotter, layout rebuild: "
                   f"{f(cs.get('rebuild_blocked'), ' s')}; first ever, arena set-up: "
                   f"{f(cs.get('first_boundary_s'), ' s')}), "
                   f"COMPLETE {f(cs.get('in_memory'), ' s')}, JIT flush {f(fl, ' s')}, "
                   f"flush raw ratio {f(C.ratio(cs.get('raw'), fl), 'x')}\n")
        print(out[-1], flush=True)
        tc, hf = rows_d.get("torch-checkpointing", {}), rows_d.get("hf enable_jit_checkpoint", {})
        if tc.get("first_save_blocked") is not None or hf.get("grace_s") is not None:
            out.append(f"torch-checkpointing {case['label']}: first save blocked "
                       f"{f(tc.get('first_save_blocked'), ' s')} (starts its writer process). "
                       f"hf enable_jit_checkpoint: SIGTERM -> durable "
                       f"{f(hf.get('signal_to_durable'), ' s')} (its fixed kill_wait grace "
                       f"{f(hf.get('grace_s'), ' s')} + the save; training stops for the save)\n")
            print(out[-1], flush=True)
    return "\n".join(out)


def plot(cases: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ["cudasnap", "torch.save", "dcp.save", "dcp.async_save", "dcp.async_save+stager",
             "torchsnapshot.take", "torchsnapshot.async_take", "dlrover.memory", "dlrover.disk",
             "torch-checkpointing", "hf enable_jit_checkpoint"]
    fig, axes = plt.subplots(len(cases), 3, figsize=(16, 3.6 * len(cases)), squeeze=False)
    for row, case in zip(axes, cases):
        rd = summarize(case)
        peers = [p for p in order if p in rd and rd[p].get("blocked") is not None]
        colors = ["#d62728" if p == "cudasnap" else "#1f77b4" for p in peers]
        for ax, key, title, log in (
                (row[0], "blocked", "training thread blocked (s, log)", True),
                (row[1], "durable", "call -> durable (s); cudasnap: JIT flush", False),
                (row[2], "restore_disk", "restore from disk (s)", False)):
            vals = [(rd[p].get("flush") if key == "durable" and p == "cudasnap" else rd[p].get(key))
                    for p in peers]
            xs = [i for i, v in enumerate(vals) if v]
            ax.bar(xs, [vals[i] for i in xs], color=[colors[i] for i in xs])
            ax.set_xticks(range(len(peers)))
            ax.set_xticklabels(peers, rotation=35, ha="right", fontsize=7)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{case['label']} ({case['bytes'] / C.GB:.1f} GB, {case['tensors']} "
                         f"tensors): {title}", fontsize=8)
            for i in xs:
                ax.annotate(f"{vals[i]:.3g}", (i, vals[i]), ha="center", va="bottom", fontsize=6)
    fig.suptitle("cudasnap vs peers, CPU host (lower is better; red = cudasnap)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> Any:
    p = C.base_parser(__doc__.split("\n\n")[0], quick_sizes="0.1")
    p.add_argument("--many-size", type=float, default=1.0, help="GB of the many-tensors case (0: off)")
    p.add_argument("--many-tensors", type=int, default=4000, help="tensors of the many case")
    p.add_argument("--groups", default=",".join(GROUPS), help="peer groups to run")
    p.add_argument("--png", default=str(PNG), help="bar chart output ('' for none)")
    p.add_argument("--timeout", type=float, default=900, help="per peer group and case (s)")
    p.add_argument("--child", default=None, help=argparse_suppress())
    p.add_argument("--size", type=float, help=argparse_suppress())
    p.add_argument("--tensors", type=int, default=8, help=argparse_suppress())
    p.add_argument("--dir", help=argparse_suppress())
    p.add_argument("--result", help=argparse_suppress())
    a = p.parse_args(argv)
    if a.child:
        a.group = a.child
        return a
    C.finish_args(a)
    if a.quick:
        a.many_size = min(a.many_size, 0.1)
    a.groups = [g.strip() for g in a.groups.split(",") if g.strip()]
    return a


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a)
    tmp = C.disk_tmpdir(a.tmp, "peers")
    print(f"# peers: {time.strftime('%Y-%m-%d %H:%M:%S')}; {C.machine_line()}; "
          f"disk dir {C.disk_line(tmp)}", flush=True)
    specs = [(f"{s:g} GB few", s, 8) for s in a.sizes]
    if a.many_size > 0:
        specs.append((f"{a.many_size:g} GB many", a.many_size, a.many_tensors))
    print(f"# cases {[x[0] for x in specs]}, repeats {a.repeats}, groups {a.groups}\n", flush=True)
    t0 = time.perf_counter()
    cases = []
    try:
        for label, size, tensors in specs:
            # worst peer: state S + a staging copy S + a restore copy S (+ cudasnap's 2S arena)
            fit = C.fit_size(size, ram_per_gb=4.2, shm_per_gb=2.1, what=f"peers {label}")
            if fit is None:
                continue
            if fit != size:
                label = f"{fit:g} GB {label.split()[-1]} (sized down)"
            case = {"label": label, "size_gb": fit, "tensors": tensors, "repeats": a.repeats,
                    "groups": []}
            for g in a.groups:
                C.log(f"{label}: {g}")
                res = run_group(g, fit, tensors, a, tmp)
                case["groups"].append(res)
                case.setdefault("bytes", res.get("bytes"))
                if res.get("tensors"):
                    case["tensors"] = res["tensors"]
                C.free_mem()
            case["bytes"] = case.get("bytes") or int(fit * C.GB)
            cases.append(case)
    finally:
        C.rm(tmp)
    report(cases)
    if a.png and cases:
        plot(cases, Path(a.png))
        print(f"bar chart: {a.png}")
    print(f"total wall time {time.perf_counter() - t0:.0f} s", flush=True)
    if a.json:
        C.emit_json({"bench": "peers", "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
