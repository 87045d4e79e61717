"""Snapshotter on the CPU backend: bitwise resume after a real crash, fallback, errors."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import parts
from torch import nn

import cudasnap
from cudasnap.errors import ConfigError, IncompatibleSnapshot, SnapshotError
from cudasnap.storage import posix
from tools.faults import layout as L
from tools.faults.trainlib import Job

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
STEPS = 9


def run_job(*args, timeout=120):
    p = subprocess.run([sys.executable, str(HELPERS / "train_job.py"), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1",
                            "OPENBLAS_NUM_THREADS": "1"})
    return p


def load(path):
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def assert_same_state(got, want):
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not (got[k].dtype == want[k].dtype and np.array_equal(got[k],
                                                                                   want[k]))]
    assert not bad, f"differs from the uninterrupted run: {bad}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    p = run_job("ref", "--steps", STEPS, "--out", out)
    assert p.returncode == 0, p.stderr
    return load(out)


@pytest.mark.slow
def test_bitwise_resume_after_sigkill(snap_env, reference):
    """Crash (SIGKILL) after step 4; resume from shared memory (step 4) and, in a copy of
    the directory without the arena, from disk (step 3, the last flush); both must end
    bitwise equal to the uninterrupted run: parameters, BN buffers, AdamW state, LR,
    scheduler, data position and the torch/numpy/Python RNG streams."""
    d = snap_env.dir
    p = run_job("crash", "--steps", STEPS, "--crash-after", 4, "--flush-every", 2,
                "--dir", d, "--job", snap_env.job)
    assert p.returncode == -9, p.stderr  # really killed, no cleanup ran
    arena = snap_env.arena_path()
    assert arena.exists()
    assert [s.step for s in posix.list_snapshots(d)] == [3, 1]
    disk_copy = snap_env.tmp / "disk-only"
    shutil.copytree(d, disk_copy)

    p = run_job("resume", "--steps", STEPS, "--dir", d, "--job", snap_env.job,
                "--out", snap_env.tmp / "shm.npz")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.splitlines()[0])
    assert info["start"] == 5 and info["restore"]["source"] == "shm", info
    assert_same_state(load(snap_env.tmp / "shm.npz"), reference)
    assert not arena.exists()  # the resumed run closed cleanly

    p = run_job("resume", "--steps", STEPS, "--dir", disk_copy, "--job",
                snap_env.sub_job("disk"), "--out", snap_env.tmp / "disk.npz")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.splitlines()[0])
    assert info["start"] == 4 and info["restore"]["source"] == "disk", info
    assert_same_state(load(snap_env.tmp / "disk.npz"), reference)


# ------------------------------------------------------------- in process

def _snapshotter(env, job, **kw):
    return cudasnap.Snapshotter(job.model, job.opt, directory=env.dir, extra=job.extra(),
                                copy_threads=1, **kw)


def _train(env, steps, flush_at=(), job=None):
    """Runs `steps` steps with a Snapshotter; returns the job and per-step tensor copies."""
    job = job or Job(dim=16)
    seen = {}
    snap = _snapshotter(env, job)
    try:
        for step in range(steps):
            job.step()
            snap.boundary(step)
            seen[step] = {k: v.clone() for k, v in job.tensors().items()}
            if step in flush_at:
                snap.flush()
    finally:
        snap.close()
    return job, seen


def _restore(env, job=None):
    job = job or Job(dim=16)
    snap = _snapshotter(env, job)
    try:
        start = snap.restore_latest()
        return job, start, snap.stats()["restore"]
    finally:
        snap.close()


def _equal_to(job, tensors):
    got = job.tensors()
    return all(torch.equal(got[k], v) for k, v in tensors.items()) and sorted(got) == sorted(
        tensors)


def test_flipped_byte_in_newest_data_falls_back_with_warning(snap_env, caplog):
    _, seen = _train(snap_env, 4, flush_at=(1, 3))
    assert not snap_env.arena_files()  # close() removed the arena: restore comes from disk
    newest = snap_env.dir / "step-00000003" / "data.bin"
    L.flip_byte(newest, newest.stat().st_size // 2, 0x10)
    with caplog.at_level(logging.WARNING, logger="cudasnap"):
        job, start, info = _restore(snap_env)
    assert start == 2 and info["source"] == "disk", info
    assert _equal_to(job, seen[1])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in m and "chunk" in m for m in warned), warned


@pytest.mark.parametrize("damage", ["torn", "digit"])
def test_corrupt_manifest_falls_back(snap_env, caplog, damage):
    _, seen = _train(snap_env, 4, flush_at=(1, 3))
    man = snap_env.dir / "step-00000003" / "manifest.json"
    raw = man.read_bytes()
    if damage == "torn":
        man.write_bytes(raw[:-20])
    else:  # still valid JSON and a sane manifest, but the learning rate is wrong
        m = re.search(rb'"lr":\d\.\d+', raw)
        L.flip_byte(man, m.end() - 1, 0x01)
        json.loads(man.read_bytes())
    with caplog.at_level(logging.WARNING, logger="cudasnap"):
        job, start, _ = _restore(snap_env)
    assert start == 2 and _equal_to(job, seen[1])
    assert any(str(man) in r.getMessage() for r in caplog.records)


def test_corrupt_shared_memory_slot_falls_back_to_older_slot(snap_env, caplog):
    job = Job(dim=16)
    snap = _snapshotter(snap_env, job)
    seen = {}
    for step in range(3):
        job.step()
        snap.boundary(step)
        seen[step] = {k: v.clone() for k, v in job.tensors().items()}
        if step == 1:
            snap.flush()
    snap.wait()
    arena = parts.arena(snap)
    slot = arena.newest_complete()
    assert arena.slot_info(slot)["step"] == 2
    snap.close(keep_arena=True)
    path = snap_env.arena_path()
    hdr = path.read_bytes()[:L.AH_SIZE]
    cap, meta, chunk = L.u64(hdr, L.AH_DATA_CAP), L.u64(hdr, L.AH_META_CAP), L.u64(hdr, L.AH_CHUNK)
    L.flip_byte(path, L.data_offset(slot, cap, meta, chunk) + 100)
    with caplog.at_level(logging.WARNING, logger="cudasnap"):
        job2, start, info = _restore(snap_env)
    # The newest slot (step 2) is torn; the other slot still holds step 1, which is
    # also on disk: shared memory wins the tie (faster), never the torn slot.
    assert start == 2 and info["source"] == "shm" and _equal_to(job2, seen[1])
    assert any(str(path) in r.getMessage() and "CRC32C" in r.getMessage()
               for r in caplog.records)


def test_restore_from_shared_memory_in_a_new_snapshotter(snap_env):
    job = Job(dim=16)
    snap = _snapshotter(snap_env, job)
    for step in range(3):
        job.step()
        snap.boundary(step)
    snap.wait()
    want = {k: v.clone() for k, v in job.tensors().items()}
    want_host = job.host_state()
    snap.close(keep_arena=True)
    job2, start, info = _restore(snap_env)
    assert start == 3 and info["source"] == "shm"
    assert _equal_to(job2, want) and job2.host_state() == want_host


def test_fresh_run_over_a_dead_runs_arena_flushes_its_own_steps(snap_env):
    """An arena left behind (same job name) holds step 7 of an earlier run; a new run
    that starts over at step 0 without restoring must flush its own step, not step 7."""
    job = Job(dim=16)
    snap = _snapshotter(snap_env, job)
    for step in range(5, 8):
        job.step()
        snap.boundary(step)
    snap.close(keep_arena=True)
    shutil.rmtree(snap_env.dir)
    job = Job(dim=16)
    snap = _snapshotter(snap_env, job)
    try:
        for step in range(2):
            job.step()
            snap.boundary(step)
        want = {k: v.clone() for k, v in job.tensors().items()}
        path = snap.flush()
    finally:
        snap.close()
    assert path is not None and path.name == "step-00000001"
    job2, start, _ = _restore(snap_env)
    assert start == 2 and _equal_to(job2, want)


class Other(nn.Module):
    def __init__(self, shape_dim=16, dtype=torch.float32, rename=False):
        super().__init__()
        first = nn.Linear(16, shape_dim).to(dtype)
        layers = [first, nn.BatchNorm1d(shape_dim), nn.ReLU(), nn.Dropout(0.2),
                  nn.Linear(shape_dim, 16)]
        self.net = nn.Sequential(*layers) if rename else None
        if not rename:
            for i, m in enumerate(layers):
                self.add_module(str(i), m)


@pytest.mark.parametrize("variant,match", [
    ("shape", r"'model\.0\.weight' has shape \[16, 16\] in the snapshot, \[20, 16\]"),
    ("dtype", r"'model\.0\.weight' has dtype float32 in the snapshot, float64"),
    ("name", r"'model\.0\.weight' has no counterpart"),
], ids=["shape", "dtype", "name"])
def test_incompatible_model_names_first_mismatching_tensor(snap_env, variant, match):
    _train(snap_env, 2, flush_at=(1,))
    model = {"shape": lambda: Other(shape_dim=20), "dtype": lambda: Other(dtype=torch.float64),
             "name": lambda: Other(rename=True)}[variant]()
    opt = torch.optim.AdamW(model.parameters())
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir)
    try:
        with pytest.raises(IncompatibleSnapshot, match=match) as ei:
            snap.restore_latest()
        assert "step-00000001" in str(ei.value)
    finally:
        snap.close()


@pytest.mark.parametrize("where", ["below-a-file", "proc"])
def test_unwritable_directory_fails_at_construction(snap_env, where):
    if where == "below-a-file":
        f = snap_env.tmp / "file"
        f.write_text("x")
        target = f / "ckpt"
    else:
        target = Path("/proc/self/cudasnap-ckpt")
    job = Job(dim=16)
    with pytest.raises(ConfigError, match="not writable") as ei:
        cudasnap.Snapshotter(job.model, job.opt, directory=target)
    assert str(target) in str(ei.value)
    assert not snap_env.arena_files()


def test_unserialisable_extra_state_names_the_key(snap_env):
    class Sampler:
        def state_dict(self):
            return {"order": [3, 1, 2], "key_fn": lambda x: x}

        def load_state_dict(self, d):
            pass

    job = Job(dim=16)
    snap = cudasnap.Snapshotter(job.model, job.opt, directory=snap_env.dir,
                                extra={"sampler": Sampler()})
    try:
        job.step()
        with pytest.raises(ConfigError, match=r"extra\.sampler\.state\.key_fn.*function"):
            snap.boundary(0)
    finally:
        snap.close()
    with pytest.raises(ConfigError, match=r"extra\['bad'\]"):
        cudasnap.Snapshotter(job.model, job.opt, directory=snap_env.dir, extra={"bad": 3})


def test_second_snapshotter_on_a_directory_is_refused(snap_env):
    job = Job(dim=16)
    snap = _snapshotter(snap_env, job)
    try:
        with pytest.raises(SnapshotError, match="in use by another job"):
            _snapshotter(snap_env, Job(dim=16))
    finally:
        snap.close()


@pytest.mark.gpu
def test_cuda_backend_round_trip(snap_env):
    """Same contract on the CUDA backend: a restored state is the snapshotted one, bit for bit
    (from shared memory and from disk)."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir)
    try:
        for step in range(3):
            model(torch.randn(16, 64, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            snap.boundary(step)
        snap.wait()
        assert snap.stats()["backend"] == "cuda"
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        want_opt = {(i, k): v.detach().cpu().clone() for i, p in enumerate(model.parameters())
                    for k, v in opt.state[p].items()}
        assert snap.flush().name == "step-00000002"
    finally:
        snap.close(keep_arena=True)
    for source in ("shm", "disk"):
        if source == "disk":
            for p in snap_env.arena_files():
                p.unlink()
        model2, opt2 = build()
        snap2 = cudasnap.Snapshotter(model2, opt2, directory=snap_env.dir)
        try:
            assert snap2.restore_latest() == 3
            assert snap2.stats()["restore"]["source"] == source
        finally:
            snap2.close(keep_arena=True)
        for k, v in model2.state_dict().items():
            assert torch.equal(v.cpu(), want[k]), (source, k)
        for i, p in enumerate(model2.parameters()):
            for k, v in opt2.state[p].items():
                assert torch.equal(v.cpu(), want_opt[(i, k)]), (source, i, k)


def test_mixed_dtype_views_of_one_storage(snap_env):
    """Parameters that are views of one storage at unequal alignments (a bf16 view at
    byte 2, a float32 view at byte 32) share a copy range; each keeps its alignment."""
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            flat = torch.arange(64, dtype=torch.float32)
            self.a = nn.Parameter(flat.view(torch.bfloat16)[1:9])
            self.b = nn.Parameter(flat[8:16])

    m = Views()
    assert m.a.data_ptr() % 4 == 2 and m.b.data_ptr() - m.a.data_ptr() == 30
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir)
    try:
        snap.boundary(0)
        snap.flush()
        want = (m.a.detach().clone(), m.b.detach().clone())
    finally:
        snap.close()
    m2 = Views()
    with torch.no_grad():
        m2.a.zero_()
        m2.b.zero_()
    snap = cudasnap.Snapshotter(m2, torch.optim.SGD(m2.parameters(), lr=0.1),
                                directory=snap_env.dir)
    try:
        assert snap.restore_latest() == 1
    finally:
        snap.close()
    assert torch.equal(m2.a, want[0]) and torch.equal(m2.b, want[1])
