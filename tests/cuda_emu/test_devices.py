"""Several emulated devices (CUDAEMU_DEVICES=4): a rank on ``cuda:3`` makes no CUDA
context on devices 0-2 — not from the trainer's thread (whose current device may still
be 0), not from cudasnap's own threads (copy completion, flush, arena set-up).

On an 8-GPU node a context on GPU 0 from every rank costs GPU 0 ~500 MB per rank and is
the classic "every rank on GPU 0" bug. The emulator counts a device's primary context
once a call that needs one runs with that device current (as the runtime does), and
refuses cross-device misuse as CUDA does (an event recorded on another device's
stream, a kernel launched on another device's stream).

Children (``python test_devices.py MODE``) start with the 4 devices (the lane's own
process has one).
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402
from helpers import parts  # noqa: E402

DEVICES = 4


def contexts() -> list[int]:
    lib = ctypes.CDLL(None)
    fn = lib.cudaemu_counter
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_ulonglong
    mask = int(fn(b"contexts"))
    return [d for d in range(DEVICES) if mask >> d & 1]


def child(mode: str, directory: str) -> dict[str, Any]:
    """Trains on cuda:3 (``set_device``: torch.cuda.set_device(3) first, as torchrun
    scripts do; ``no-set-device``: tensors on cuda:3, the current device left at 0;
    ``plain``: the same without cudasnap, the baseline), then snapshots, flushes and
    restores into a fresh model on cuda:3."""
    import torch
    from emu_train import build, diff, state_bytes, train_step

    assert torch.cuda.device_count() == DEVICES
    if mode == "set_device":
        torch.cuda.set_device(3)
    dev = "cuda:3"
    model, opt = build(device=dev)
    out: dict[str, Any] = {"after_model": contexts(), "mode": mode}
    if mode == "plain":
        for i in range(3):
            train_step(model, opt, i)
        torch.cuda.synchronize(dev)
        out["end"] = contexts()
        return out
    import cudasnap

    snap = cudasnap.Snapshotter(model, opt, directory=directory, job=f"dev-{os.getpid()}",
                                health=False)
    try:
        for i in range(3):
            train_step(model, opt, i)
            snap.boundary(i)
        assert snap.wait(timeout=60)
        want = state_bytes(snap)
        snap.flush()
        out["backend"] = snap.stats()["backend"]
        out["private_pinned"] = parts.cuda(snap).fallback_reason is not None
    finally:
        snap.close()
    model2, opt2 = build(seed=5, device=dev)
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=directory,
                                 job=f"dev2-{os.getpid()}", health=False)
    try:
        out["restored"] = snap2.restore_latest()
        out["bitwise"] = not diff(state_bytes(snap2), want)
    finally:
        snap2.close()
    torch.cuda.synchronize(dev)
    out["end"] = contexts()
    return out


def run_child(mode: str) -> dict[str, Any]:
    env = dict(os.environ, CUDAEMU_DEVICES=str(DEVICES))
    if mode.endswith("+preparer"):  # every arena made on cudasnap's preparer thread
        env["CUDASNAP_ARENA_SYNC_MAX_BYTES"] = "0"
        mode = mode.removesuffix("+preparer")
    if mode.endswith("+refused"):  # cudaHostRegister refused: the private pinned arena
        env["CUDAEMU_FAULTS"] = "host_register:801"
        mode = mode.removesuffix("+refused")
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, __file__, mode, d], env=env, capture_output=True,
                           text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_torch_sees_the_emulated_devices(emu: Any) -> None:
    env = dict(os.environ, CUDAEMU_DEVICES=str(DEVICES))
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(DEVICES), r.stderr


@pytest.fixture(scope="module")
def torch_alone() -> dict[str, Any]:
    """The baseline: the same training on cuda:3 without cudasnap."""
    return run_child("plain")


@pytest.mark.parametrize("mode", ["set_device", "no-set-device", "no-set-device+preparer",
                                  "no-set-device+refused+preparer"])
def test_a_rank_on_cuda3_makes_no_context_on_devices_0_to_2(emu: Any, mode: str,
                                                             torch_alone: dict[str, Any]) -> None:
    assert torch_alone["end"] == [3], f"torch alone made contexts on {torch_alone['end']}"
    got = run_child(mode)
    assert got["backend"] == "cuda"
    assert got["private_pinned"] == ("refused" in mode)
    assert got["restored"] == 3 and got["bitwise"], got  # resumes at the step after 2
    assert got["end"] == [3], f"with cudasnap: contexts on devices {got['end']}, want [3]"


def test_cross_device_misuse_is_refused(emu: Any) -> None:
    env = dict(os.environ, CUDAEMU_DEVICES=str(DEVICES))
    r = subprocess.run([sys.executable, __file__, "misuse", "-"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"record_other_device": 400, "record_same_device": 0, "wait_cross": 0,
                   "mem_on_1": True, "mem_on_2": False}, got


def pin_on_a_thread(directory: str) -> dict[str, Any]:
    """What the arena preparer does off the training thread (a fresh thread: its
    current device is 0), with cudaHostRegister refused: the private pinned arena is
    allocated, used and freed for cuda:3 only."""
    import threading

    import torch

    from cudasnap._cuda import native, pin_arena

    torch.empty(1, device="cuda:3")
    C = native()
    path = os.path.join("/dev/shm", f"cudasnap-devtest-{os.getpid()}-r0.arena")
    out: dict[str, Any] = {}

    def run() -> None:
        arena = C.Arena.create(path, 2, 1 << 20, 1 << 16, 1 << 16, "devtest")
        priv, reason = pin_arena(arena, 3)
        out["private"] = reason is not None and priv is not arena
        del priv

    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out["end"] = contexts()
    return out


def test_the_private_pinned_arena_is_made_for_its_device_on_any_thread(emu: Any) -> None:
    env = dict(os.environ, CUDAEMU_DEVICES=str(DEVICES), CUDAEMU_FAULTS="host_register:801")
    r = subprocess.run([sys.executable, __file__, "pin-thread", "-"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["private"], got
    assert got["end"] == [3], f"contexts on devices {got['end']}, want [3]"


def misuse() -> dict[str, Any]:
    """Event/stream rules across devices: CUDA refuses recording an event of device 1 on
    a stream of device 2 (cudaErrorInvalidResourceHandle, 400); a stream of one device
    may wait on another's event. Memory is counted on the device it was made on."""
    import torch

    rt = ctypes.CDLL(None)
    vp = ctypes.c_void_p
    rt.cudaEventCreate.argtypes = [ctypes.POINTER(vp)]
    rt.cudaEventRecord.argtypes = [vp, vp]
    rt.cudaStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
    rt.cudaemu_counter.argtypes = [ctypes.c_char_p]
    rt.cudaemu_counter.restype = ctypes.c_ulonglong
    s1 = torch.cuda.Stream(device=1)
    s2 = torch.cuda.Stream(device=2)
    with torch.cuda.device(1):
        ev = vp()
        assert rt.cudaEventCreate(ctypes.byref(ev)) == 0
    with torch.cuda.device(2):
        other = rt.cudaEventRecord(ev, vp(s2.cuda_stream))
        rt.cudaGetLastError()
    with torch.cuda.device(1):
        same = rt.cudaEventRecord(ev, vp(s1.cuda_stream))
    with torch.cuda.device(2):  # a recorded event of device 1 orders a stream of device 2
        wait = rt.cudaStreamWaitEvent(vp(s2.cuda_stream), ev, 0)
    x = torch.empty(1 << 20, device="cuda:1")
    return {"record_other_device": other, "record_same_device": same, "wait_cross": wait,
            "mem_on_1": rt.cudaemu_counter(b"device_bytes:1") >= x.nbytes,
            "mem_on_2": rt.cudaemu_counter(b"device_bytes:2") > 0}


if __name__ == "__main__":
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "misuse":
        print(json.dumps(misuse()))
    elif mode == "pin-thread":
        print(json.dumps(pin_on_a_thread(directory)))
    else:
        print(json.dumps(child(mode, directory)))
