"""cudasnap's NVML path through the real nvidia-ml-py (pynvml, ctypes) against cudaemu's NVML
(tools/cudaemu/nvml.cpp), with faults posted the way the driver reports them: an Xid
event, uncorrected ECC, remapped rows, a recovery action, a lost GPU; and the whole chain
in a training process: Xid 79 -> just-in-time flush of the newest COMPLETE slot -> exit 76
-> a fresh process resumes bit for bit from disk.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.triggers import Collector

from cudasnap.triggers import nvml as _nvml
from cudasnap.triggers.nvml_source import NvmlSource

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture
def nvml_clean(emu: Any) -> Any:
    emu.fault("nvml_clear")
    yield emu
    emu.fault("nvml_clear")


def test_real_pynvml_reads_the_emulated_device(nvml_clean: Any) -> None:
    assert _nvml.init() is None, "pynvml could not initialise against the emulated NVML"
    try:
        status = _nvml.read_gpu_status()
    finally:
        _nvml.shutdown()
    assert len(status) == 1
    s = status[0]
    assert "cudaemu" in str(s.get("name")), s
    assert s.get("ecc_uncorrected") == 0 and s.get("temperature") == 40, s


def test_nvml_faults_become_triggers(nvml_clean: Any) -> None:
    emu = nvml_clean
    got = Collector()
    src = NvmlSource(got, poll_interval=3600)  # poll_once() by hand; events on its thread
    assert src.available
    src.start()
    try:
        src.notify_step(12)
        emu.fault("nvml_xid:79")
        t = got.wait_for(1, timeout=10)[0]
        assert (t.kind, t.device, t.code, t.xid_class, t.step) == ("xid", 0, 79, "fatal", 12)
        emu.fault("nvml_ecc:3")  # 3 uncorrected (and a double-bit ECC event)
        emu.fault("nvml_remap:0:1")
        emu.fault("nvml_recovery:2")
        src.poll_once()
        deadline = time.monotonic() + 10
        want = {"ecc_dbe", "ecc_uncorrected", "remap_failure", "recovery_action"}
        while not want <= set(got.kinds()) and time.monotonic() < deadline:
            time.sleep(0.05)
            src.poll_once()
        assert want <= set(got.kinds()), got.kinds()
        n = len(got.items)
        src.poll_once()  # edge-triggered: nothing new
        assert len(got.items) == n
        emu.fault("nvml_lost:1")
        src.poll_once()
        lost = [t for t in got.wait_for(n + 1, timeout=10) if t.kind == "gpu_lost"]
        assert lost and lost[0].device == 0
    finally:
        src.stop()


def test_xid_flushes_just_in_time_and_the_job_resumes(snap_env: Any, emu: Any) -> None:
    """A training child with the guard on; Xid 79 arrives through NVML after step 3's
    snapshot completed: it flushes step 3, exits 76; a fresh process resumes at 4."""
    env = dict(os.environ, CUDASNAP_HEALTH="1", CUDASNAP_POLL_S="0.2",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDASNAP_INJECT", None)
    out = snap_env.tmp / "at_xid.pt"
    lane = str(HERE / "test_cuda_lane.py")
    p = subprocess.run([sys.executable, lane, "xid", "--dir", str(snap_env.dir), "--job",
                        snap_env.job, "--out", str(out), "--steps", "4"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 76, p.stdout[-2000:] + p.stderr[-4000:]
    assert "xid" in p.stderr.lower(), p.stderr[-3000:]
    assert (snap_env.dir / "step-00000003").is_dir()
    for f in snap_env.arena_files():
        f.unlink()  # the job's node is gone: only the disk copy is left
    env.pop("CUDASNAP_HEALTH")
    out2 = snap_env.tmp / "resumed.pt"
    p = subprocess.run([sys.executable, lane, "resume", "--dir", str(snap_env.dir), "--job",
                        snap_env.job + "-b", "--out", str(out2)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    res = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")][-1]
    assert res["start"] == 4 and res["source"] == "disk", res
    import torch
    from emu_train import diff

    assert diff(torch.load(out2), torch.load(out)) == []
