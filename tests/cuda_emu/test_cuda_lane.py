"""The Snapshotter's CUDA path end to end, under the emulated CUDA runtime.

torch's real caching allocator, streams and events; cudasnap's CUDA copy engine,
allocator tracker, arena registration, fences, completion + CRC32C, flush,
restore (host-to-device) and rollback. State changes through host-to-device
copies (tests/cuda_emu/emu_train.py). Each check has a negative control or a
value that a broken mechanism could not produce.

Child processes run this file as a script (``python test_cuda_lane.py MODE``),
inheriting the emulator from the environment.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from emu_train import build, diff, state_bytes, train_step  # noqa: E402
from helpers import parts  # noqa: E402
from helpers.children import last_json, run_script  # noqa: E402
from helpers.slots import read_slot  # noqa: E402

COPY_DELAY_US = 20_000


def make_snap(model: Any, opt: Any, directory: Path, job: str, **kw: Any) -> Any:
    import cudasnap

    kw.setdefault("health", False)
    return cudasnap.Snapshotter(model, opt, directory=directory, job=job, **kw)


def run_steps_checked(snap: Any, model: Any, opt: Any, steps: int, start: int = 0) -> int:
    """Each boundary's slot == a synchronous copy of the state at that boundary, while the
    next step's forward and optimizer step run right after it (the copy is delayed on the
    copy stream, so only the fences keep those writes behind it)."""
    checked = 0
    for i in range(start, start + steps):
        train_step(model, opt, i)
        want = state_bytes(snap)
        if parts.cuda(snap) is not None:
            parts.cuda(snap).engine.set_test_copy_delay_us(COPY_DELAY_US)
        snap.boundary(i)
        train_step(model, opt, 1000 + i)  # writes the state being copied, behind the fences
        assert snap.wait(timeout=60), "snapshot did not complete"
        info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert info["step"] == i
        if i > start:  # the first boundary builds the engine: its copy is not delayed
            bad = diff(got, want)
            assert not bad, f"step {i}: slot differs from the state at the boundary: {bad}"
            checked += 1
    parts.cuda(snap).engine.set_test_copy_delay_us(0)
    return checked


# ---------------------------------------------------------------- in process
def test_snapshot_bytes_equal_state_at_boundary(snap_env: Any, emu: Any) -> None:
    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        assert snap.restore_latest() == 0
        before = emu.counter("cudaMemcpyAsync")
        assert run_steps_checked(snap, model, opt, steps=4) == 3
        st = snap.stats()
        assert st["backend"] == "cuda"
        assert parts.cuda(snap).fallback_reason is None  # the shm arena itself is page-locked
        assert emu.is_pinned(parts.arena(snap).data_ptr(0), 1)
        assert emu.counter("cudaMemcpyAsync") > before  # the engine's D2H copies ran here
        assert parts.cuda(snap).engine.last_memcpy_calls >= 1
    finally:
        snap.close()


def test_without_fences_the_slot_is_torn(snap_env: Any, emu: Any) -> None:
    """Negative control: with the fences removed, the next step's writes overtake the copy
    (held on its stream until they are done) and the slot is torn."""
    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        train_step(model, opt, 0)
        snap.boundary(0)  # builds the engine
        assert snap.wait(timeout=60)
        parts.copier(snap).fence = lambda phase: None  # the hooks call it: now they order nothing
        train_step(model, opt, 1)
        want = state_bytes(snap)
        copy = parts.cuda(snap).engine.copy_stream
        emu.hold(copy)
        snap.boundary(1)
        stepped = threading.Event()
        waiter = emu.release_when(copy, stepped.is_set,
                                  waiter=torch.cuda.current_stream().cuda_stream)
        train_step(model, opt, 1001)  # not fenced: lands before the held copy
        stepped.set()
        waiter.join(60)
        assert not waiter.blocked, "the unfenced step waited for the copy stream"
        assert snap.wait(timeout=60)
        info, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert info["step"] == 1
        assert sorted(diff(got, want)) == sorted(want), "every tensor was overwritten first"
    finally:
        snap.close()


def test_allocator_tracker_sees_torch_allocations(snap_env: Any, emu: Any) -> None:
    """The trace hook on torch's real caching allocator: blocks appear and go."""
    from cudasnap import _C

    torch.cuda.init()
    x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    reg = _C.attach_allocator_tracker(16384)
    assert _C.attached_allocator_registry() is reg
    reg.drain()
    live = {b[0]: b[1] for b in reg.live_blocks(0)}
    assert x.data_ptr() in live and live[x.data_ptr()] >= x.numel()  # seeded from snapshot()
    y = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")  # after attach: a trace event
    reg.drain()
    assert y.data_ptr() in {b[0] for b in reg.live_blocks(0)}
    addr = y.data_ptr()
    del y
    torch.cuda.synchronize()
    reg.drain()
    assert addr not in {b[0] for b in reg.live_blocks(0)}
    assert reg.stats()["applied"] >= 2
    segs = reg.segments(0)
    assert any(s[0] <= x.data_ptr() < s[0] + s[1] for s in segs)
    del x


def test_coverage_reports_an_unregistered_copy(snap_env: Any, emu: Any) -> None:
    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        train_step(model, opt, 0)
        snap.boundary(0)
        assert snap.wait(timeout=60)
        ema = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # nobody registered it
        ema.copy_(torch.ones(1 << 20, dtype=torch.uint8))
        cov = snap.coverage()
        assert cov["available"]
        assert cov["uncovered_bytes"] >= ema.numel()
        assert any(a <= ema.data_ptr() < a + s for a, s in map(tuple, cov["largest_uncovered"]))
    finally:
        snap.close()


def test_rollback_restores_bytes_in_place(snap_env: Any, emu: Any) -> None:
    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        train_step(model, opt, 0)
        snap.boundary(0)
        assert snap.wait(timeout=60)
        saved = state_bytes(snap)
        ptrs = {lt.name: lt.tensor.data_ptr() for lt in snap.state.live_tensors()}
        cuda_rng = torch.cuda.get_rng_state()
        for i in range(1, 4):
            train_step(model, opt, i)
        torch.rand(8, device="cuda")  # advances the CUDA generator (host-side offset)
        assert len(diff(state_bytes(snap), saved)) == len(saved)
        assert not torch.equal(torch.cuda.get_rng_state(), cuda_rng)
        assert snap.rollback() == 1
        torch.cuda.synchronize()
        assert diff(state_bytes(snap), saved) == []
        assert {lt.name: lt.tensor.data_ptr() for lt in snap.state.live_tensors()} == ptrs
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
        assert opt.state[model.w]["n"] == 1  # host state of the optimizer came back too
        train_step(model, opt, 1)
        snap.boundary(1)
        assert snap.wait(timeout=60)
    finally:
        snap.close()


def test_gather_kernel_copies_small_ranges(snap_env: Any, emu: Any) -> None:
    """The engine's gather kernel (csrc/cuda/gather.cu), emulated by cudaemu, copies
    ranges below gather_max_bytes into the mapped arena (here: every range)."""
    from cudasnap import _cuda

    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        train_step(model, opt, 0)
        snap.boundary(0)  # builds the backend
        assert snap.wait(timeout=60)
        gather = _cuda.native().CudaCopyEngine(0, 1, True, 1 << 30)
        assert gather.gather_small and gather.gather_max_bytes == 1 << 30
        old = parts.swap_engine(snap, gather)
        launches = emu.counter("kernel_launches")
        train_step(model, opt, 1)
        want = state_bytes(snap)
        snap.boundary(1)
        assert snap.wait(timeout=60)
        _, got = read_slot(parts.arena(snap), parts.arena(snap).newest_complete())
        assert diff(got, want) == []
        assert gather.last_gathered >= 1 and gather.last_memcpy_calls == 0
        assert emu.counter("kernel_launches") > launches
        parts.swap_engine(snap, old)
        gather.shutdown(10.0)
    finally:
        snap.close()


def test_pinned_fallback_when_registration_is_refused(snap_env: Any, emu: Any,
                                                     caplog: Any) -> None:
    """cudaHostRegister refused (as under gVisor): a private pinned arena, said loudly (a
    WARNING with the reason and the fix; stats() shows it)."""
    caplog.set_level(logging.WARNING, logger="cudasnap")
    emu.fault("host_register:801")  # cudaErrorNotSupported
    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        assert run_steps_checked(snap, model, opt, steps=3) == 2
        reason = parts.cuda(snap).fallback_reason
        assert reason and "cudaHostRegister" in reason and "cudaErrorNotSupported" in reason
        assert not parts.arena(snap).shared
        staging = snap.stats()["staging"]
        assert staging["survives_crash"] is False and "cudaHostRegister" in staging["fallback_reason"]
        warned = [r for r in caplog.records if r.levelno == logging.WARNING
                  and "NOT survive a crash" in r.getMessage()]
        assert warned and "Fix:" in warned[0].getMessage(), caplog.text
        assert emu.is_pinned(parts.arena(snap).data_ptr(0), 1)  # cudaHostAlloc'd
        assert snap.flush() is not None  # the in-process flush still works
    finally:
        snap.close()


def test_flush_then_restore_in_a_fresh_process(snap_env: Any, emu: Any) -> None:
    model, opt = build()
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        for i in range(3):
            train_step(model, opt, i)
            snap.boundary(i)
        assert snap.wait(timeout=60)
        want = state_bytes(snap)
        path = snap.flush()
        assert path is not None and path.name == "step-00000002"
    finally:
        snap.close(flush=False)
    for p in snap_env.arena_files():
        p.unlink()  # only the disk copy is left
    out = snap_env.tmp / "restored.pt"
    child = run_child("resume", "--dir", snap_env.dir, "--job", snap_env.job + "-b", "--out", out)
    assert child.returncode == 0, child.stderr[-3000:]
    res = last_json(child)
    assert res["start"] == 3 and res["source"] == "disk", res
    got = torch.load(out)
    assert diff(got, want) == []


def test_kill9_leaves_a_slot_a_new_process_restores(snap_env: Any, emu: Any) -> None:
    out1, out2 = snap_env.tmp / "before.pt", snap_env.tmp / "after.pt"
    child = run_child("crash", "--dir", snap_env.dir, "--job", snap_env.job, "--out", out1,
                      "--steps", 4)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert snap_env.arena_path().exists()
    child = run_child("resume", "--dir", snap_env.dir, "--job", snap_env.job, "--out", out2)
    assert child.returncode == 0, child.stderr[-3000:]
    res = last_json(child)
    assert res["start"] == 4 and res["source"] == "shm", res
    assert diff(torch.load(out2), torch.load(out1)) == []


def test_sticky_error_fails_the_copy_and_keeps_the_previous_slot(snap_env: Any, emu: Any) -> None:
    """A sticky cudaErrorIllegalAddress during a snapshot copy: that job fails, the
    previous COMPLETE slot stays the newest, and the JIT flush writes it to disk."""
    out = snap_env.tmp / "good.pt"
    child = run_child("sticky", "--dir", snap_env.dir, "--job", snap_env.job, "--out", out)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    res = last_json(child)
    assert res["failed_step"] == 3 and res["newest"] == 2, res
    assert "cudaErrorIllegalAddress" in res["error"], res
    assert res["flushed"].endswith("step-00000002"), res
    assert res["sticky"] == "cudaErrorIllegalAddress"
    for p in snap_env.arena_files():
        p.unlink()
    out2 = snap_env.tmp / "restored.pt"
    child = run_child("resume", "--dir", snap_env.dir, "--job", snap_env.job + "-b", "--out", out2)
    assert child.returncode == 0, child.stderr[-3000:]
    assert last_json(child)["start"] == 3
    assert diff(torch.load(out2), torch.load(out)) == []


def test_expandable_segments(snap_env: Any, emu: Any) -> None:
    """The same fenced snapshots with torch's expandable segments (the driver's virtual
    memory calls, emulated), tracked as expandable segments."""
    child = run_child("expandable", "--dir", snap_env.dir, "--job", snap_env.job, "--out", "-",
                      env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    res = last_json(child)
    assert res["checked"] == 2 and res["tracking"], res
    assert res["expandable_segments"] >= 1, res


def test_expandable_segments_with_a_tensor_over_several_mappings(snap_env: Any, emu: Any) -> None:
    """A 72 MiB parameter spans several physical mappings of one expandable segment (the
    emulator once refused such copies: "invalid argument"); snapshots stay exact."""
    child = run_child("expandable", "--dir", snap_env.dir, "--job", snap_env.job, "--out", "-",
                      "--big-mib", "72",
                      env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    res = last_json(child)
    assert res["checked"] == 2 and res["tracking"] and res["expandable_segments"] >= 1, res


def test_cuda_malloc_async_backend(snap_env: Any, emu: Any) -> None:
    """torch's cudaMallocAsync allocator backend: the trace hook needs the native caching
    allocator, so tracking is off (said once, with the reason) and copy plans are checked
    against the named tensors; every snapshot is still the state at its boundary."""
    child = run_child("expandable", "--dir", snap_env.dir, "--job", snap_env.job, "--out", "-",
                      env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
    res = last_json(child)
    assert res["checked"] == 2 and not res["tracking"], res
    assert "allocator tracking unavailable" in child.stderr and "cudaMallocAsync" in child.stderr


# ------------------------------------------------------------------ children
def run_child(mode: str, *args: Any, timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_script(__file__, mode, *args, env=env, timeout=timeout)


def child_crash(a: argparse.Namespace) -> None:
    model, opt = build(seed=0)
    snap = make_snap(model, opt, Path(a.dir), a.job)
    assert snap.restore_latest() == 0
    for i in range(a.steps):
        train_step(model, opt, i)
        snap.boundary(i)
    assert snap.wait(timeout=60)
    torch.save(state_bytes(snap), a.out)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit


def child_resume(a: argparse.Namespace) -> None:
    model, opt = build(seed=7)  # other initial values: only a restore makes them equal
    snap = make_snap(model, opt, Path(a.dir), a.job)
    start = snap.restore_latest()
    torch.cuda.synchronize()
    torch.save(state_bytes(snap), a.out)
    src = (snap.last_restore() or {}).get("source")
    for i in range(start, start + 2):  # and it trains on
        train_step(model, opt, i)
        snap.boundary(i)
    assert snap.wait(timeout=60)
    print(json.dumps({"start": start, "source": src}), flush=True)
    snap.close(flush=False)


def child_sticky(a: argparse.Namespace) -> None:
    import ctypes

    lib = ctypes.CDLL(None)
    model, opt = build(seed=0)
    snap = make_snap(model, opt, Path(a.dir), a.job)
    for i in range(3):
        train_step(model, opt, i)
        snap.boundary(i)
        assert snap.wait(timeout=60)
    train_step(model, opt, 3)
    # The next D2H copy of the engine faults (sticky, as an Xid 31/43 would).
    n = lib.cudaemu_counter(b"cudaMemcpyAsync")
    lib.cudaemu_fault(f"sticky:cudaMemcpyAsync:{n + 1}".encode())
    # The fault is asynchronous: it fails the job on the completion thread, or (as on a
    # GPU, where any later call reports it) a call of boundary() itself: CudaError.
    from cudasnap.errors import CudaError

    job_err = ""
    try:
        snap.boundary(3)
        snap.wait(timeout=60)
    except CudaError as e:
        job_err = str(e)
    arena = parts.arena(snap)
    newest = arena.newest_complete()
    err = ""
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        err = str(e)
    flushed = snap.flush()
    # The state the previous slot holds (step 2), from the slot itself.
    _, got = read_slot(arena, newest)
    torch.save(got, a.out)
    print(json.dumps({"failed_step": 3, "newest": arena.slot_info(newest)["step"],
                      "error": job_err or err, "flushed": str(flushed),
                      "sticky": "cudaErrorIllegalAddress" if "illegal memory" in err else err}),
          flush=True)
    os._exit(0)  # the CUDA context is gone: no orderly teardown


def child_xid(a: argparse.Namespace) -> None:
    """Trains with the guard on (CUDASNAP_HEALTH=1, NVML through cudaemu); an Xid 79 after
    step ``steps - 1``'s snapshot: the guard flushes it and exits 76."""
    import ctypes
    import time

    model, opt = build(seed=0)
    snap = make_snap(model, opt, Path(a.dir), a.job, health=True)
    for i in range(a.steps):
        train_step(model, opt, i)
        snap.boundary(i)
        assert snap.wait(timeout=60)
    torch.save(state_bytes(snap), a.out)
    ctypes.CDLL(None).cudaemu_fault(b"nvml_xid:79")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the next step's work would run here
        time.sleep(0.05)
    print(json.dumps({"error": "no exit after the Xid"}), flush=True)
    sys.exit(1)


def child_expandable(a: argparse.Namespace) -> None:
    model, opt = build(seed=0)
    if a.big_mib:  # a parameter larger than one mapping of an expandable segment
        model.big = torch.nn.Parameter(torch.zeros(a.big_mib << 18, device="cuda"))
        opt = type(opt)(model.parameters())
    snap = make_snap(model, opt, Path(a.dir), a.job)
    start = 0
    if a.big_mib:  # a large arena is made in the background, from the first boundary on
        train_step(model, opt, 0)
        snap.boundary(0)
        assert snap.arena_ready(120)
        start = 1
    checked = run_steps_checked(snap, model, opt, steps=3, start=start)
    reg = parts.cuda(snap).registry
    segs = list(reg.segments(0)) if reg is not None else []
    print(json.dumps({"checked": checked, "tracking": reg is not None,
                      "expandable_segments": sum(1 for s in segs if s[2]),
                      "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}), flush=True)
    snap.close(flush=False)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["crash", "resume", "sticky", "xid", "expandable"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--big-mib", type=int, default=0)
    a = ap.parse_args(argv)
    os.environ["CUDASNAP_JOB"] = a.job
    {"crash": child_crash, "resume": child_resume, "sticky": child_sticky, "xid": child_xid,
     "expandable": child_expandable}[a.mode](a)


if __name__ == "__main__":
    main(sys.argv[1:])
