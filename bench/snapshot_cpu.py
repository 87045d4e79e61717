"""cudasnap on the CPU backend: boundary cost, snapshot, flush and restore vs peers (issue 2).

For each state size (params + AdamW state) and two shapes -- "few" (2 parameters:
8 state tensors) and "many" (1,000 parameters: 4,000 state tensors) -- it measures,
on the same bytes and in the same run:

* host time blocked in ``Snapshotter.boundary()`` (first boundary, which builds
  the staging arena, reported apart) and the time until the snapshot is COMPLETE
  (``wait()``); ``opt.step()`` runs between boundaries, so the fence hook runs;
* ``flush()`` (newest slot to disk, durable) next to a raw write+fsync of the same
  staged bytes: ``os.write`` + fsync, and ``cudasnap._C.write_buffer_file`` with 1
  thread; the writers take turns (rotated order) so disk noise hits all alike;
* ``restore_latest()`` in a fresh Snapshotter of the same model, from shared
  memory and from disk (arena renamed away, data.bin evicted from the page
  cache) next to ``torch.load`` (+ copy into the live tensors) of a ``torch.save``;
  from disk twice: the chunk-by-chunk path (read, CRC32C-check, copy each chunk
  into the live tensors: ``core.file_copy`` reading ``storage.posix.DataFile``) and the whole-file path it
  replaced (``read_data`` into a buffer, then the copy), the three in rotated order;
* peers: torch.save+fsync, torch.distributed.checkpoint.save and async_save
  (single-rank gloo group on a FileStore): time blocked, time until durable.

    python bench/snapshot_cpu.py [--sizes 1,4] [--repeats 3] [--quick] [--json]

``--restore-only``: only the restores from disk (one snapshot and one torch.save
made first): the chunk-by-chunk path, the whole-file path, torch.load + copy and a
plain read of data.bin (the disk's floor), rotated, each after evicting the files
from the page cache; with where each path's time goes (read + verify, the copy,
Python) from timers around ``posix.read_data``, ``file_copy.run_plan`` and
``TrainingState.apply``.

``--first-boundary``: only the start-up stall (issue 15 target 1). Per size, in
the same run and alternating, the old behaviour (``arena_sync_max_bytes`` huge:
the arena is made inside the first ``boundary()``) and the default (made by the
background preparer from construction on): constructor time, first
``boundary()`` blocked, the longest ``boundary()`` until the first COMPLETE
snapshot, skipped boundaries, construction -> first COMPLETE; then the same after
a restart that adopts the arena left behind (``close(keep_arena=True)``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (also silences the pynvml redirector warning)

# Every boundary copies (what these figures measure): the default overhead budget would
# skip boundaries once it has measured the cost (cudasnap.core.cadence). Old trees ignore it.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")

SHAPES = {"few": 2, "many": 1000}  # parameters; x4 state tensors (param, exp_avg, exp_avg_sq, step)


def parse_args(argv: list[str] | None = None) -> Any:
    p = C.base_parser(__doc__.split("\n\n")[0], quick_sizes="0.1,0.2")
    p.add_argument("--shapes", default="few,many", help="few,many (subset allowed)")
    p.add_argument("--tensors", type=int, default=None,
                   help="state tensors of the 'many' shape (default 4,000; e.g. 40000); "
                        "bench/boundary_cpu.py measures boundary() alone over tensor counts")
    p.add_argument("--boundaries", type=int, default=6,
                   help="boundaries measured per case after the first (default 6)")
    p.add_argument("--peers", choices=["all", "few", "none"], default="few",
                   help="dcp.save/async_save in which shapes (torch.save always runs); "
                        "default: the 'few' shape only (peers.py covers many tensors)")
    p.add_argument("--first-boundary", action="store_true",
                   help="measure only the first boundary's stall, old vs background arena")
    p.add_argument("--restore-only", action="store_true",
                   help="measure only the restores from disk (chunk-by-chunk, whole-file, "
                        "torch.load, raw read), with their breakdown")
    a = C.finish_args(p.parse_args(argv))
    if a.tensors is not None:
        SHAPES["many"] = max(1, a.tensors // 4)  # 4 state tensors per AdamW parameter
    if a.quick:
        a.boundaries = min(a.boundaries, 4)
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for s in a.shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s!r}; expected few and/or many")
    return a


# ------------------------------------------------------------------ peers
def torch_save(model: Any, opt: Any, path: Path) -> float:
    import torch

    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    C.fsync_file(path)
    return time.perf_counter() - t0


def torch_restore(model: Any, opt: Any, path: Path) -> float:
    import torch

    C.drop_cache(path)
    t0 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for idx, st in sd["optim"]["state"].items():
            live = opt.state[params[int(idx)]]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    live[k].copy_(v)
    dt = time.perf_counter() - t0
    del sd
    C.free_mem()
    return dt


def dcp_save(flat: dict[str, Any], path: Path) -> float:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(flat, checkpoint_id=str(path))  # FileSystemWriter(sync_files=True): fsync'd
    C.fsync_dir(path)
    return time.perf_counter() - t0


def dcp_async(flat: dict[str, Any], path: Path) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    fut = dcp.async_save(flat, checkpoint_id=str(path))
    blocked = time.perf_counter() - t0
    res = getattr(fut, "upload_completion", fut)
    res.result()
    C.fsync_dir(path)
    return blocked, time.perf_counter() - t0


# ------------------------------------------------------------- disk restore paths
@contextlib.contextmanager
def disk_path(mode: str) -> Iterator[None]:
    """Restores from disk inside take ``mode``'s path: "chunks" (``posix.DataFile``: each
    chunk read, CRC32C-checked and copied into the live tensors, the file's head read ahead
    while the manifest is parsed; what ``Restorer.restore_dir`` reads through
    ``PosixStorage.open_data``), "chunks_noahead" (the same without the read-ahead:
    ``posix.READ_AHEAD_BYTES`` 0) or "whole" (``storage.read_data``: the whole file into a
    buffer, then the copy, no read-ahead; ``open_data`` replaced for the duration)."""
    from cudasnap import storage
    from cudasnap.storage import posix

    saved, saved_ahead = storage.PosixStorage.open_data, posix.READ_AHEAD_BYTES
    if mode == "whole":
        def open_data(store: Any, ref: Any, manifest: Any, threads: int = 4, *,
                      allow_foreign_owner: bool | None = None, ahead: Any = None) -> Any:
            return store.read_data(ref, manifest, threads,
                                   allow_foreign_owner=allow_foreign_owner)
        storage.PosixStorage.open_data = open_data  # type: ignore[method-assign]
    elif mode not in ("chunks", "chunks_noahead"):
        raise ValueError(mode)
    if mode != "chunks":
        posix.READ_AHEAD_BYTES = 0
    try:
        yield
    finally:
        storage.PosixStorage.open_data, posix.READ_AHEAD_BYTES = saved, saved_ahead  # type: ignore[method-assign]


@contextlib.contextmanager
def breakdown(out: dict[str, float]) -> Iterator[None]:
    """Adds the seconds spent in the restore's stages to ``out``: manifest (load_manifest),
    read_verify (read_data: read + CRC32C of the whole file), scatter (file_copy.run_plan:
    read + CRC32C + copy, chunk by chunk), apply (TrainingState.apply: checks, planning,
    the copy, host state; includes scatter); and ahead_bytes, the bytes the scatter took
    from the read-ahead instead of reading them."""
    from cudasnap.core import file_copy
    from cudasnap.core.state import TrainingState
    from cudasnap.storage import posix

    targets = [(posix, "load_manifest", "manifest"), (posix, "read_data", "read_verify"),
               (file_copy, "run_plan", "scatter"), (TrainingState, "apply", "apply")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]

    def timer(fn: Any, key: str) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                got = fn(*args, **kw)
                if key == "scatter" and isinstance(got, dict):
                    out["ahead_bytes"] = out.get("ahead_bytes", 0.0) + got.get("ahead", 0)
                return got
            finally:
                out[key] = out.get(key, 0.0) + time.perf_counter() - t0
        return run

    for (obj, name, key), (_, _, fn) in zip(targets, saved):
        setattr(obj, name, timer(fn, key))
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def raw_read(path: Path, piece: int = 4 << 20) -> float:
    """A plain read of ``path`` (one thread, ``piece`` bytes per read into one buffer,
    nothing checked or copied): the disk's floor for a restore of that file."""
    buf = bytearray(piece)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


def disk_restore(mk: Any, mode: str, sources: set[str]) -> tuple[float, dict[str, float]]:
    """A fresh Snapshotter's ``restore_latest()`` through ``mode``'s path (``disk_path``):
    (seconds, breakdown)."""
    parts: dict[str, float] = {}
    with disk_path(mode), breakdown(parts):
        s2 = mk()
        try:
            t0 = time.perf_counter()
            s2.restore_latest()
            dt = time.perf_counter() - t0
            sources.add(str((s2.stats().get("restore") or {}).get("source")))
        finally:
            s2.close()
    return dt, parts


# ------------------------------------------------------------------ one case
def run_case(size_gb: float, shape: str, a: Any, tmp: Path, with_peers: bool) -> dict[str, Any] | None:
    import torch  # noqa: F401

    import cudasnap
    from cudasnap._native import native

    # Peak: live state S + 2 arena slots 2S (in /dev/shm) + one restore/load/staging copy S.
    size = C.fit_size(size_gb, ram_per_gb=4.15, shm_per_gb=2.1, what=f"snapshot_cpu {shape}")
    if size is None:
        return None
    n_params = SHAPES[shape]
    case = f"{size:g} GB {shape}"
    C.log(f"case {case}: building state ({n_params} params + AdamW)")
    t_build, (model, opt) = C.timed(lambda: C.build_state(size, n_params))
    flat = C.flat_state(model, opt)
    nbytes = C.state_bytes(flat)
    ntensors = len(flat)
    d = tmp / f"{shape}-{size:g}"
    d.mkdir()
    snapdir = d / "snap"
    job = f"bench-{os.getpid()}-{shape}-{size:g}".replace(".", "_")
    mk = lambda: cudasnap.Snapshotter(model, opt, directory=snapdir, job=job, keep=2,  # noqa: E731
                                      health=False)
    snap = mk()
    res: dict[str, Any] = {"case": case, "size_gb": size, "shape": shape, "tensors": ntensors,
                           "bytes": nbytes, "build_s": t_build}

    # --- boundaries -------------------------------------------------------
    step = 0
    snap.arena_ready()  # steady-state figures: --first-boundary measures the start
    t0 = time.perf_counter()
    snap.boundary(step)
    first_blocked = time.perf_counter() - t0
    snap.wait()
    first_complete = time.perf_counter() - t0
    res["first_boundary_s"] = first_blocked
    res["first_complete_s"] = first_complete
    res["arena_setup_s"] = snap.stats().get("arena_setup_seconds")
    blocked, complete, steps = [], [], []
    for _ in range(0 if a.restore_only else a.boundaries):
        t0 = time.perf_counter()
        opt.step()  # the fence pre-hook runs (nothing in flight: wait() returned)
        steps.append(time.perf_counter() - t0)
        step += 1
        t0 = time.perf_counter()
        snap.boundary(step)
        blocked.append(time.perf_counter() - t0)
        snap.wait()
        complete.append(time.perf_counter() - t0)
    st = snap.stats()
    res.update(boundary_s=blocked, complete_s=complete, opt_step_s=steps,
               layout_rebuilds=st.get("layout_rebuilds"), skipped=st.get("skipped"))
    if a.restore_only:
        return restore_only_case(res, a, snap, mk, model, opt, d)
    C.log(f"  boundary median {C.med(blocked) * 1e3:.2f} ms, complete {C.med(complete):.2f} s")

    # --- durable writes: flush vs raw vs peers, rotated order ----------------
    # "many" has the same bytes as "few": its raw baseline is os.write only, and torch.save
    # runs once (the file torch.load restores), to keep the default run short.
    writers = ["flush", "raw_os", "raw_native", "torch_save"] if shape == "few" else \
        ["flush", "raw_os", "torch_save"]
    if with_peers:
        C.init_dist(tmp)
        writers += ["dcp_save", "dcp_async"]
    w: dict[str, list[Any]] = {k: [] for k in writers}
    tpath = d / "torch.pt"
    for r in range(a.repeats):
        step += 1
        opt.step()
        snap.boundary(step)
        snap.wait()
        arena = native().Arena.open(str(snap.arena_path), False)
        slot = arena.newest_complete()
        n = arena.slot_info(slot)["data_bytes"]
        order = writers[r % len(writers):] + writers[:r % len(writers)]
        if shape != "few" and r > 0:
            order = [k for k in order if k != "torch_save"]
        for kind in order:
            C.free_mem()
            if kind == "flush":
                t0 = time.perf_counter()
                path = snap.flush()
                w[kind].append(time.perf_counter() - t0)
                C.drop_cache(path)
            elif kind == "raw_os":
                w[kind].append(C.raw_write_os(arena.data_view(slot, n), d / "raw-os.bin"))
            elif kind == "raw_native":
                w[kind].append(C.raw_write_native(arena.data_ptr(slot), n, d / "raw-c.bin", 1))
            elif kind == "torch_save":
                C.rm(tpath)
                w[kind].append(torch_save(model, opt, tpath))
                C.drop_cache(tpath)
            elif kind == "dcp_save":
                w[kind].append(dcp_save(flat, d / "dcp"))
                C.rm(d / "dcp")
            elif kind == "dcp_async":
                w[kind].append(dcp_async(flat, d / "dcp-async"))
                C.rm(d / "dcp-async")
            C.log(f"  repeat {r}: {kind} {w[kind][-1]}")
        res["staged_bytes"] = n
        del arena
    res["writes"] = w

    # --- restores ------------------------------------------------------------
    rs: dict[str, list[float]] = {"shm": [], "shm_prepared": [], "disk": [], "disk_whole": [],
                                  "torch_load": [], "memcpy": []}
    # memcpy baseline (issue 15 target 6): the same byte count, tensor to tensor
    import numpy as np

    mc_src = torch.empty(res["bytes"], dtype=torch.uint8).fill_(1)
    mc_dst = torch.empty_like(mc_src).fill_(2)
    sources: dict[str, set[str]] = {"shm": set(), "disk": set()}
    latest = snapdir / (snapdir / "latest").read_text().strip()
    C.drop_cache(latest)
    for r in range(a.repeats):
        C.free_mem()
        # shared memory: a fresh Snapshotter adopts the arena the old one left
        snap.close(keep_arena=True)
        snap = mk()
        t0 = time.perf_counter()
        mc_dst.copy_(mc_src)
        t1 = time.perf_counter()
        np.copyto(mc_dst.numpy(), mc_src.numpy())  # libc memcpy, one thread
        # the faster of the two: torch's copy_ is the slower one on some CPUs
        rs["memcpy"].append(min(t1 - t0, time.perf_counter() - t1))
        t0 = time.perf_counter()
        snap.restore_latest()
        rs["shm"].append(time.perf_counter() - t0)
        sources["shm"].add(str((snap.stats().get("restore") or {}).get("source")))
        # the same, once the adopted arena's background pre-fault has finished (it shares
        # the cores and memory bandwidth with the restore above)
        snap.close(keep_arena=True)
        snap = mk()
        snap.arena_ready()
        t0 = time.perf_counter()
        snap.restore_latest()
        rs["shm_prepared"].append(time.perf_counter() - t0)
        # disk: arena renamed away first; the chunk-by-chunk path, the whole-file path and
        # torch.load in rotated order, each from a cold page cache
        snap.close(keep_arena=True)
        arena_path = Path(snap.arena_path)
        away = arena_path.with_name(arena_path.name + ".away")
        os.rename(arena_path, away)
        kinds = ["disk", "disk_whole", "torch_load"]
        try:
            for kind in kinds[r % 3:] + kinds[:r % 3]:
                C.free_mem()
                C.drop_cache(latest)
                if kind == "torch_load":
                    rs[kind].append(torch_restore(model, opt, tpath))
                else:
                    rs[kind].append(disk_restore(mk, "chunks" if kind == "disk" else "whole",
                                                 sources["disk"])[0])
        finally:
            os.rename(away, arena_path)
        C.drop_cache(latest)
        snap = mk()
    del mc_src, mc_dst
    res["restore"] = rs
    res["restore_sources"] = {k: sorted(v) for k, v in sources.items()}
    C.log(f"  restore shm {C.med(rs['shm']):.2f} s, disk {C.med(rs['disk']):.2f} s "
          f"(whole-file {C.med(rs['disk_whole']):.2f} s), "
          f"torch.load {C.med(rs['torch_load']):.2f} s ({res['restore_sources']})")
    snap.close()
    del snap, flat, model, opt
    C.rm(d)
    C.free_mem()
    return res


def restore_only_case(res: dict[str, Any], a: Any, snap: Any, mk: Any, model: Any, opt: Any,
                      d: Path) -> dict[str, Any]:
    """``--restore-only``: one flush and one torch.save, then per repeat the restores from
    disk (chunk by chunk with and without the read-ahead, whole file), torch.load + copy
    and a raw read of data.bin, in rotated order, each from a cold page cache; the arena is
    gone (no shm source)."""
    snap.flush()
    tpath = d / "torch.pt"
    torch_save(model, opt, tpath)
    snapdir = Path(snap.directory)
    latest = snapdir / (snapdir / "latest").read_text().strip()
    snap.close(flush=False)  # the arena goes with it: restores read the disk
    kinds = ["disk", "disk_noahead", "disk_whole", "torch_load", "raw_read"]
    modes = {"disk": "chunks", "disk_noahead": "chunks_noahead", "disk_whole": "whole"}
    rs: dict[str, list[float]] = {k: [] for k in kinds}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in modes}
    loads: list[float] = []
    sources: set[str] = set()
    for r in range(a.repeats):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            C.free_mem()
            C.drop_cache(latest)
            loads.append(os.getloadavg()[0])
            if kind == "torch_load":
                rs[kind].append(torch_restore(model, opt, tpath))
            elif kind == "raw_read":
                rs[kind].append(raw_read(latest / "data.bin"))
            else:
                dt, bd = disk_restore(mk, modes[kind], sources)
                rs[kind].append(dt)
                parts[kind].append(bd)
            C.log(f"  repeat {r}: {kind} {rs[kind][-1]:.3f} s (load {loads[-1]:.1f})")
    res.update(restore=rs, breakdown=parts, restore_sources={"disk": sorted(sources)},
               load_avg=[min(loads), max(loads)])
    del snap, model, opt
    C.rm(d)
    C.free_mem()
    return res


def report_restore_only(results: list[dict[str, Any]], a: Any) -> str:
    f, m = C.fmt, C.med
    rows = []
    for r in results:
        rs = r["restore"]
        gb = r["bytes"] / C.GB
        dk, wh, tl, raw = m(rs["disk"]), m(rs["disk_whole"]), m(rs["torch_load"]), m(rs["raw_read"])
        na = m(rs["disk_noahead"])
        rows.append([r["case"], r["tensors"], f(dk, " s"), f(gb / dk, " GB/s"), f(na, " s"),
                     f(wh, " s"), f(tl, " s"), f(raw, " s"), f(C.ratio(tl, dk), "x"),
                     f(C.ratio(tl, na), "x"), f(C.ratio(tl, wh), "x"), f(C.ratio(raw, dk), "x"),
                     "/".join(r["restore_sources"]["disk"]),
                     f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f}"])
    out = [C.print_table(
        "Restore from disk into the live model + optimizer (page cache evicted before each)",
        ["case", "tensors", "cudasnap, chunk by chunk", "GB/s", "same, no read-ahead",
         "cudasnap, whole file (before)", "torch.load+copy", "raw read of data.bin",
         "torch.load / chunks", "torch.load / no read-ahead", "torch.load / whole file",
         "raw / chunks", "sources", "load avg"], rows,
        f"Medians of {a.repeats} repeats, the five in rotated order. Chunk by chunk: "
        "storage.posix.DataFile (each chunk read into a small buffer, CRC32C-checked, then "
        "copied into the live tensors; the file's first 256 MiB read on a native thread "
        "while the manifest is parsed and the copy planned, posix.READ_AHEAD_BYTES); no "
        "read-ahead: the same with READ_AHEAD_BYTES 0; whole file: read_data (the file into "
        "a new buffer, every chunk checked) then the copy; raw: one thread reading data.bin "
        "in 4 MiB pieces into one buffer, nothing checked or copied.")]
    rows = []
    for r in results:
        bd = r["breakdown"]
        tot = r["restore"]

        def part(kind: str, key: str, bd: dict[str, Any] = bd) -> float | None:
            return m([x.get(key, 0.0) for x in bd[kind]])

        ch_py = m([x["apply"] - x.get("scatter", 0.0) for x in bd["disk"]])
        wh_cp = m([x["apply"] for x in bd["disk_whole"]])
        ahead = part("disk", "ahead_bytes")
        rows.append([r["case"], f(m(tot["disk"]), " s"), f(part("disk", "manifest"), " s"),
                     f"{(ahead or 0) / 2**20:.0f} MiB",
                     f(part("disk", "scatter"), " s"), f(ch_py, " s"),
                     f(m(tot["disk_whole"]), " s"), f(part("disk_whole", "manifest"), " s"),
                     f(part("disk_whole", "read_verify"), " s"), f(wh_cp, " s")])
    out.append(C.print_table(
        "Where a restore from disk spends its time (medians)",
        ["case", "chunks: total", "manifest", "taken from the read-ahead",
         "read+verify+copy (scatter)",
         "Python (checks, plan)", "whole file: total", "manifest", "read+verify (read_data)",
         "copy + Python (apply)"], rows,
        "total = restore_latest() of a fresh Snapshotter (listing, manifest, arena hold, "
        "apply); the parts are timers around posix.load_manifest, posix.read_data, "
        "file_copy.run_plan and TrainingState.apply (Python = apply - scatter)."))
    return "\n".join(out)


# ------------------------------------------------------------ first boundary
def _burn(seconds: float) -> None:
    """Spends ``seconds`` of this thread's CPU time (the baseline call)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _until_complete(mk: Any, opt: Any, step: int, limit_s: float = 600.0) -> dict[str, Any]:
    """Constructs a Snapshotter, then boundaries (with the fence-only opt.step() between)
    until the first snapshot is COMPLETE; the loop pauses 10 ms per boundary like a
    short training step.

    Each boundary is followed, in the same loop, by a baseline call that burns the
    thread CPU time the boundary itself used: on a loaded machine a call of that cost
    can wait for a core for tens of ms, so the worst wall time of the baseline is the
    floor no code on the training thread can go below (the boundary's own share is its
    thread CPU time, and its wall time above the baseline's).
    """
    t0 = time.perf_counter()
    snap = mk()
    ctor = time.perf_counter() - t0
    blocked: list[float] = []
    cpu: list[float] = []
    base: list[float] = []
    t_end = t0 + limit_s
    while time.perf_counter() < t_end:
        opt.step()
        b0, c0 = time.perf_counter(), time.thread_time()
        snap.boundary(step)
        blocked.append(time.perf_counter() - b0)
        cpu.append(time.thread_time() - c0)
        b0 = time.perf_counter()
        _burn(cpu[-1])
        base.append(time.perf_counter() - b0)
        step += 1
        if snap.stats()["snapshots"] and snap.wait(limit_s):
            break
        time.sleep(0.01)
    st = snap.stats()
    return {"snap": snap, "step": step, "ctor_s": ctor, "first_s": blocked[0],
            "max_s": max(blocked), "max_cpu_s": max(cpu), "max_base_s": max(base),
            "boundaries": len(blocked),
            "skipped": st["skipped_not_ready"], "to_complete_s": time.perf_counter() - t0,
            "huge_pages": (st.get("staging") or {}).get("huge_pages")}


def first_boundary_case(size_gb: float, a: Any, tmp: Path) -> dict[str, Any] | None:
    import cudasnap

    # live state S + 3 arena slots (2 + spare) in /dev/shm
    size = C.fit_size(size_gb, ram_per_gb=4.3, shm_per_gb=3.1, what="first boundary")
    if size is None:
        return None
    model, opt = C.build_state(size, SHAPES["few"])
    res: dict[str, Any] = {"size_gb": size, "modes": {}}
    modes = {"old (in boundary)": 1 << 62, "background (default)": None}
    for r in range(a.repeats):
        names = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in names:
            job = f"bench-fb-{os.getpid()}-{r}-{len(res['modes'].get(name, []))}"
            d = tmp / job
            mk = lambda: cudasnap.Snapshotter(  # noqa: E731
                model, opt, directory=d, job=job, keep=1, health=False,
                arena_sync_max_bytes=modes[name], flush_on_close=False)
            C.free_mem()
            first = _until_complete(mk, opt, 0)
            first.pop("snap").close(keep_arena=True)
            C.free_mem()
            again = _until_complete(mk, opt, first["step"])  # restart: adopts the arena
            again.pop("snap").close()
            C.rm(d)
            res["modes"].setdefault(name, []).append({"start": first, "restart": again})
            C.log(f"  {size:g} GB {name}: first boundary {first['first_s'] * 1e3:.2f} ms, max "
                  f"{first['max_s'] * 1e3:.2f} ms (its CPU {first['max_cpu_s'] * 1e3:.2f} ms, "
                  f"baseline {first['max_base_s'] * 1e3:.2f} ms), "
                  f"ctor {first['ctor_s'] * 1e3:.1f} ms, "
                  f"skipped {first['skipped']}; restart first {again['first_s'] * 1e3:.2f} ms, "
                  f"max {again['max_s'] * 1e3:.2f} ms, ctor {again['ctor_s'] * 1e3:.1f} ms")
    del model, opt
    C.free_mem()
    return res


def report_first(results: list[dict[str, Any]], a: Any) -> str:
    f, m = C.fmt, C.med
    rows = []
    for r in results:
        old = r["modes"]["old (in boundary)"]
        for name, runs in r["modes"].items():
            for when in ("start", "restart"):
                xs = [x[when] for x in runs]
                base = m([x[when]["max_s"] for x in old])
                mx = m([x["max_s"] for x in xs])
                rows.append([f"{r['size_gb']:g} GB", name, when,
                             f(m([x["ctor_s"] for x in xs]) * 1e3, " ms"),
                             f(m([x["first_s"] for x in xs]) * 1e3, " ms"),
                             f(mx * 1e3, " ms"),
                             f(m([x.get("max_cpu_s", 0.0) for x in xs]) * 1e3, " ms"),
                             f(m([x.get("max_base_s", 0.0) for x in xs]) * 1e3, " ms"),
                             "yes" if mx < 5e-3 else "NO",
                             f(C.ratio(base, mx), "x"),
                             f(m([x["skipped"] for x in xs]), ""),
                             f(m([x["to_complete_s"] for x in xs]), " s"),
                             xs[0]["huge_pages"]])
    return C.print_table(
        "Start-up stall: arena made in boundary() (old) vs by the background preparer",
        ["size", "arena set-up", "when", "constructor", "first boundary() blocked",
         "max boundary() until 1st COMPLETE", "its max thread CPU",
         "max baseline call (same CPU, same loop)", "< 5 ms?", "old max / this max",
         "boundaries skipped", "construction -> 1st COMPLETE", "huge pages"], rows,
        f"Medians of {a.repeats} runs per mode, modes alternated; 'restart' adopts the arena "
        "the first Snapshotter left (close(keep_arena=True)). CPU backend (no page-locking). "
        "Baseline: after each boundary the loop burns the same thread CPU time; its worst wall "
        "time is what the machine's load alone costs a call of that size.")


# ------------------------------------------------------------------ report
def report(results: list[dict[str, Any]], a: Any) -> str:
    f, m = C.fmt, C.med
    out = []
    rows = []
    for r in results:
        b = m(r["boundary_s"])
        bmax = max(r["boundary_s"])
        c = m(r["complete_s"])
        gb = r["bytes"] / C.GB
        rows.append([r["case"], r["tensors"], f(b * 1e3, " ms"), f(bmax * 1e3, " ms"),
                     "yes" if b < 1e-3 else "NO", f(c, " s"), f(gb / c, " GB/s"),
                     f(r["first_boundary_s"], " s"), f(m(r["opt_step_s"]) * 1e3, " ms")])
    out.append(C.print_table(
        "Snapshot at the boundary (CPU backend)",
        ["case", "tensors", "boundary() blocked, median", "max", "< 1 ms?", "boundary -> COMPLETE",
         "copy GB/s", "first boundary (arena set-up)", "opt.step (fence hook, no math)"], rows,
        f"{a.boundaries} boundaries per case after the first; median over them."))

    rows = []
    for r in results:
        w = r["writes"]
        gb = r["bytes"] / C.GB
        fl, ro, rn, ts = m(w["flush"]), m(w["raw_os"]), m(w.get("raw_native", [])), \
            m(w["torch_save"])
        ds, da = m(w.get("dcp_save", [])), m([x[0] for x in w.get("dcp_async", [])])
        dd = m([x[1] for x in w.get("dcp_async", [])])
        best_raw = min(x for x in (ro, rn) if x is not None)
        rows.append([r["case"], f(fl, " s"), f(gb / fl, " GB/s"), f(ro, " s"), f(rn, " s"),
                     f(C.ratio(ro, fl), "x"), f(C.ratio(rn, fl), "x"),
                     "yes" if best_raw / fl >= 0.8 else "NO",
                     f(ts, " s"), f(ds, " s"), f(da, " s"), f(dd, " s"),
                     f(da / gb if da else None, " s/GB"),
                     f(C.ratio(da, m(r["boundary_s"])), "x")])
    out.append(C.print_table(
        "Durable write of the same bytes (median, writers rotated each repeat)",
        ["case", "flush()", "flush GB/s", "raw os.write+fsync", "raw _C 1 thr",
         "flush/raw(os)", "flush/raw(_C)", ">= 0.8 of best raw?", "torch.save+fsync",
         "dcp.save", "async_save blocked", "async_save durable", "async blocked per GB",
         "async blocked / boundary blocked"], rows,
        "flush/raw = raw time / flush time (1.0 = as fast as the raw write). flush() includes "
        "manifest, fsyncs of file and directories, rename and `latest`; raw = one file, fsync."))

    rows = []
    for r in results:
        rs = r["restore"]
        gb = r["bytes"] / C.GB
        sh, dk, tl, mc = m(rs["shm"]), m(rs["disk"]), m(rs["torch_load"]), m(rs.get("memcpy", []))
        wh = m(rs.get("disk_whole", []))
        sp = m(rs.get("shm_prepared", []))
        rows.append([r["case"], f(sh, " s"), f(gb / sh, " GB/s"),
                     f(gb / mc if mc else None, " GB/s"), f(C.ratio(mc, sh), "x"),
                     "yes" if mc and mc / sh >= 0.5 else "NO", f(sp, " s"),
                     f(C.ratio(mc, sp) if sp else None, "x"),
                     f(dk, " s"), f(gb / dk, " GB/s"), f(wh, " s"),
                     f(tl, " s"), f(gb / tl, " GB/s"), f(C.ratio(tl, sh), "x"),
                     f(C.ratio(tl, dk), "x"), f(C.ratio(tl, wh), "x"),
                     "/".join(r["restore_sources"]["shm"] + r["restore_sources"]["disk"])])
    out.append(C.print_table(
        "Restore into the live model + optimizer (fresh Snapshotter, same objects)",
        ["case", "cudasnap from shm", "GB/s", "memcpy GB/s", "shm / memcpy", ">= 0.5?",
         "shm, arena prepared", "prepared / memcpy", "cudasnap from disk", "GB/s",
         "disk, whole-file path (before)", "torch.load+copy",
         "GB/s", "torch.load / shm", "torch.load / disk", "torch.load / whole-file",
         "sources seen"], rows,
        "memcpy: the faster of torch copy_ and numpy.copyto (libc memcpy) of the same byte count "
        "in the same repeat (target 6: "
        "restore from shm >= 0.5 of it; the restore also checks every chunk's CRC32C). "
        "'arena prepared': the same restore after the fresh Snapshotter's background "
        "pre-fault of the adopted arena finished (arena_ready()), which otherwise runs beside it. "
        "From disk: the arena is renamed away and data.bin / torch.pt are evicted from the page "
        "cache first (posix_fadvise DONTNEED), so the read hits the disk; 'from disk' is the "
        "chunk-by-chunk path (each chunk read, CRC32C-checked, copied into the live tensors), "
        "'whole-file' the path it replaced (the file into a buffer, then the copy); the two "
        "and torch.load run in rotated order."))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tmp = C.disk_tmpdir(a.tmp, "snapcpu")
    print(f"# snapshot_cpu: {time.strftime('%Y-%m-%d %H:%M:%S')}; {C.machine_line()}; "
          f"disk dir {C.disk_line(tmp)}", flush=True)
    print(f"# sizes {a.sizes} GB, shapes {a.shapes}, repeats {a.repeats}, peers: {a.peers}\n",
          flush=True)
    t_start = time.perf_counter()
    results = []
    if a.first_boundary:
        try:
            for size in a.sizes:
                r = first_boundary_case(size, a, tmp)
                if r is not None:
                    results.append(r)
        finally:
            C.rm(tmp)
        report_first(results, a)
        print(f"total wall time {time.perf_counter() - t_start:.0f} s", flush=True)
        if a.json:
            C.emit_json({"bench": "snapshot_cpu --first-boundary", "results": results})
        return 0
    try:
        for size in a.sizes:
            for shape in a.shapes:
                peers = a.peers == "all" or (a.peers == "few" and shape == "few")
                r = run_case(size, shape, a, tmp, peers)
                if r is not None:
                    results.append(r)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        C.rm(tmp)
    if a.restore_only:
        report_restore_only(results, a)
    else:
        report(results, a)
    print(f"total wall time {time.perf_counter() - t_start:.0f} s", flush=True)
    if a.json:
        C.emit_json({"bench": "snapshot_cpu --restore-only" if a.restore_only else "snapshot_cpu",
                     "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
