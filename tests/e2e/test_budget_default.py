"""The overhead budget's cadence (cudasnap.core.cadence) on the CPU backend, end to end: the
rest of the suite pins every boundary (tests/conftest.py), these tests unset that.

* Unset, the CPU backend copies every boundary (the budget's default holds on CUDA).
* With a 1% budget, a flush (what a signal, a health event or a hang triggers) right
  after a boundary the cadence skipped still writes that step (the live state is copied
  then: replay <= 1), and it restores bit for bit; ``wait()`` makes the newest boundary
  COMPLETE as before.
* The README's quick start under a 1% budget, killed outright (os._exit) and run again,
  resumes from at most k steps back and ends bitwise equal to a run that never failed.
The CUDA backend's default (a 1% budget) runs in tests/cuda_emu/test_gpu_check_emulated.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_readme_quickstart import quick_start


@pytest.fixture
def default_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDASNAP_OVERHEAD_BUDGET", raising=False)


def _model(seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: Any, opt: Any, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_unset_the_cpu_backend_copies_every_boundary(snap_env: Any,
                                                    default_budget: None) -> None:
    import cudasnap

    model, opt = _model(0)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    try:
        for i in range(30):
            _step(model, opt, i)
            snap.boundary(i)
        st = snap.stats()
        assert st["cadence"]["k"] == 1 and st["cadence"]["fixed"], st["cadence"]
        assert st["skipped_every"] == 0 and st["cadence"]["budget"] is None
    finally:
        snap.close(flush=False)


def test_a_flush_after_a_skipped_boundary_writes_that_step(snap_env: Any,
                                                           default_budget: None) -> None:
    import cudasnap

    model, opt = _model(0)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False, overhead_budget=0.01)
    try:
        for i in range(60):
            _step(model, opt, i)
            snap.boundary(i)
        st = snap.stats()
        c = st["cadence"]
        assert c["budget"] == 0.01 and not c["fixed"] and 1 <= c["k"] <= 64, c
        assert st["skipped_every"] > 0, st  # it did skip boundaries (a plain step timed)
        assert st["snapshots"] + st["skipped_every"] >= 60, st
        # The newest boundary, wherever the cadence stood: a flush writes step 59.
        path = snap.flush()
        assert path is not None and path.name == "step-00000059", path
        want = {k: v.clone() for k, v in model.state_dict().items()}
        want_opt = [s["exp_avg"].clone() for s in opt.state.values()]
        copies = snap.stats()["snapshots"]  # a copy at the boundary or of the live state
        _step(model, opt, 60)
        snap.boundary(60)
        assert snap.wait(timeout=60)  # COMPLETE: copied now if the cadence skipped it
        assert snap.stats()["snapshots"] == copies + 1
    finally:
        snap.close(flush=False)
    for p in snap_env.arena_files():
        p.unlink()  # only the flushed step 59 is left
    fresh, fopt = _model(1)
    snap2 = cudasnap.Snapshotter(fresh, fopt, directory=snap_env.dir, job=snap_env.job + "-b",
                                 health=False)
    try:
        assert snap2.restore_latest() == 60
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want[k]), k
        assert all(torch.equal(s["exp_avg"], w) for s, w in zip(fopt.state.values(), want_opt))
    finally:
        snap2.close(flush=False)


@pytest.mark.slow
def test_the_quick_start_killed_outright_resumes_bitwise(tmp_path: Path) -> None:
    code, script = quick_start()
    (tmp_path / "quickstart.py").write_text(code)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    for name in ("CUDASNAP_DIR", "CUDASNAP_JOB", "CUDASNAP_FRESH", "CUDASNAP_RESTART",
                 "CUDASNAP_INJECT"):
        env.pop(name, None)
    env["CUDASNAP_OVERHEAD_BUDGET"] = "0.01"  # the budget on the CPU backend
    work = tmp_path / "work"
    work.mkdir()
    (work / "quickstart.py").symlink_to(tmp_path / "quickstart.py")
    r = subprocess.run(["bash", "-c", script], cwd=work, env=env, text=True,
                       capture_output=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"resuming at step (\d+)\b", r.stderr)
    assert m, out[-3000:]
    assert 61 - 64 <= int(m.group(1)) <= 61, out[-3000:]  # <= k steps replayed, k <= 64
    assert r.stdout.strip().splitlines()[-1] == "True", out[-3000:]
