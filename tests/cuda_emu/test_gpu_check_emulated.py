"""bench/gpu_check.sh's own CUDA pieces under the emulated CUDA runtime (issue 21 items 2,
3, 5, 10 and ``--emulated``).

* the preflight (``bench/gpu_bench.py --preflight``) proves a snapshot: the background
  arena is awaited, the snapshot completes, is flushed and restores bit for bit, the
  arena is page-locked; a refused ``cudaHostRegister`` (gVisor) is accepted with its
  reason printed, and the machine facts (/dev/shm, MADV_POPULATE_WRITE, versions) too;
* a state over CUDASNAP_ARENA_SYNC_MAX_BYTES gets its arena in the background: a
  boundary before ``arena_ready()`` is skipped (what tests/cuda/test_gpu_e2e.py's
  ``make_snap`` waits for), one after it snapshots;
* a lazily-stated optimizer (tests/cuda/test_gpu_e2e.py ``LazyMomentum``) regrows the arena
  exactly once on the CUDA path: the old arena is unregistered before the new one is
  page-locked, step 0 goes to disk first;
* ``gpu_bench.py --emulated`` runs with no kernels and judges no target.
State changes through host-to-device copies (the emulator runs no kernels).
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BENCH = REPO / "bench"
for p in (str(REPO), str(BENCH), str(REPO / "tests"), str(REPO / "tests" / "cuda")):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import parts  # noqa: E402
from test_gpu_e2e import LazyMomentum  # noqa: E402  (the regrowth test's optimizer)

MiB = 1 << 20


def run_preflight() -> tuple[int, str]:
    import gpu_bench

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu_bench.preflight("cuda", timeout=60)
    return rc, out.getvalue()


def facts(text: str) -> dict[str, str]:
    return dict(line[len("fact "):].split(": ", 1) for line in text.splitlines()
                if line.startswith("fact "))


def test_preflight_proves_a_flushed_restorable_snapshot(emu: Any) -> None:
    before = emu.counter("cudaMemcpyAsync")
    rc, out = run_preflight()
    assert rc == 0, out
    f = facts(out)
    assert f["snapshot"].startswith("step 1 completed, flushed and restored bit for bit"), out
    assert f["cudaHostRegister"].startswith("ok"), out
    assert f["device"].startswith("EMULATED"), out
    assert "GiB free" in f["/dev/shm"] and f["MADV_POPULATE_WRITE"], out
    assert "torch " in f["versions"] and "driver CUDA " in f["versions"], out
    assert emu.counter("cudaMemcpyAsync") > before  # the snapshot went through the CUDA engine


def test_preflight_accepts_a_refused_register_and_prints_why(emu: Any) -> None:
    emu.fault("host_register:801")  # cudaErrorNotSupported, as gVisor may answer
    rc, out = run_preflight()
    assert rc == 0, out
    reg = facts(out)["cudaHostRegister"]
    assert reg.startswith("REFUSED (") and "cudaErrorNotSupported" in reg, out
    assert "restored bit for bit" in facts(out)["snapshot"], out


def test_preflight_fails_when_its_snapshot_is_skipped(emu: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control (issue 21 item 5: the old preflight passed with boundary(1)
    skipped and flush() returning None): with the arena held back and arena_ready()
    lying, the preflight must fail, saying why."""
    import cudasnap
    from cudasnap._testing import arena_gate

    gate = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", gate)
    monkeypatch.setattr(cudasnap.Snapshotter, "arena_ready", lambda self, timeout=None: True)
    try:
        rc, out = run_preflight()
    finally:
        gate.set()
    assert rc == 1, out
    assert "preflight FAILED: boundary(1) made no snapshot" in out, out
    assert "skipped_not_ready 1" in out, out


def params_module(n: int, numel: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.p = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(numel, device="cuda"))
                                 for _ in range(n))
    with torch.no_grad():
        for i, p in enumerate(m.p):
            p.copy_(torch.full((numel,), float(i)))
    return m


def test_a_boundary_before_the_background_arena_is_skipped(snap_env: Any, emu: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Why tests/cuda/test_gpu_e2e.py's make_snap waits for arena_ready() (issue 21 item 2)."""
    import cudasnap
    from cudasnap._testing import arena_gate

    gate = threading.Event()
    monkeypatch.setattr(arena_gate, "gate", gate)  # holds the preparer until released
    model = params_module(4, 2 * MiB)  # 32 MB x 3 slots: over the 16 MiB made at a boundary
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    try:
        snap.boundary(0)
        st = snap.stats()
        assert st["snapshots"] == 0 and st["skipped_not_ready"] == 1, st
        assert parts.arena(snap) is None
        gate.set()
        assert snap.arena_ready(60)
        snap.boundary(1)
        assert snap.wait(timeout=60)
        st = snap.stats()
        assert st["snapshots"] == 1 and st["staging"]["page_locked"], st
    finally:
        gate.set()
        snap.close()


def test_lazy_optimizer_regrows_the_arena_once_on_cuda(snap_env: Any, emu: Any) -> None:
    """tests/cuda/test_gpu_e2e.py's regrowth check on the CUDA path (issue 21 item 3)."""
    import cudasnap
    from cudasnap.storage import posix

    gc.collect()  # arenas of earlier tests in this process are unregistered when collected
    pinned0 = emu.counter("pinned_ranges")  # (some may stay pinned: count from here)
    model = params_module(4, 2 * MiB)
    opt = LazyMomentum(model.parameters())
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, job=snap_env.job,
                                health=False)
    grads = [torch.full(p.shape, 0.5) for p in model.parameters()]

    def step(k: int) -> None:  # gradients by copies; LazyMomentum's first step clones them
        for p, g in zip(model.parameters(), grads):
            p.grad = g.to("cuda")
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.p[0].copy_(torch.full(model.p[0].shape, float(k)))

    try:
        assert snap.arena_ready(60)  # sized for the parameters alone
        snap.boundary(0)
        assert snap.wait(timeout=60)
        assert emu.counter("pinned_ranges") == pinned0 + 1
        step(1)  # momentum buffers appear: the state doubles
        snap.boundary(1)  # regrowth in the background; skipped
        assert snap.arena_ready(60)
        st = snap.stats()
        assert st["arena_regrowths"] == 1 and st["skipped_not_ready"] == 1, st
        assert parts.cuda(snap).stats()["registered_arenas"] == 0  # the old arena: unregistered
        assert emu.counter("pinned_ranges") == pinned0 + 1  # only the new one is pinned
        assert any(s.step == 0 for s in posix.list_snapshots(snap_env.dir))
        step(2)
        snap.boundary(2)
        assert snap.wait(timeout=60)
        st = snap.stats()
        assert st["snapshots"] == 2 and st["arena_regrowths"] == 1, st
        assert parts.cuda(snap).stats()["registered_arenas"] == 1
        assert parts.arena(snap).slot_info(parts.arena(snap).newest_complete())["step"] == 2
    finally:
        snap.close()


def test_bench_emulated_smoke_judges_nothing(tmp_path: Path, emu: Any) -> None:
    """gpu_bench.py under the emulator: section (b), the copy+AdamW step that replaces the
    GPT there (bench/gpu_check.sh --emulated runs every section)."""
    p = subprocess.run([sys.executable, str(BENCH / "gpu_bench.py"), "--emulated",
                        "--sections", "b", "--budget", "120", "--out", str(tmp_path)],
                       cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    assert res["status"] == "complete" and not res["errors"], res
    assert res["env"]["emulated"] and res["b"], res
    assert all(r.get("ok") is None for r in res["b"]), "the emulator judged a target"
    assert res["b"][0]["snapshots"] > 0 and res["b"][0]["skipped"] == 0, res["b"]
    txt = (tmp_path / "gpu_results.txt").read_text()
    assert "NOT GPU figures" in txt and " PASS" not in txt and " MISS" not in txt, txt


def _modelled_run() -> tuple[dict[str, Any], list[str]]:
    """One ``--quick`` run of the timing-model bench: its shape and calibration asserted,
    and the timing bars it missed (an empty list: all held)."""
    p = subprocess.run([sys.executable, str(BENCH / "gpu_bench.py"), "--emulated", "--timing",
                        "h200", "--quick", "--json"], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["modelled"] is True and out["model"]["profile"] == "h200"
    m = out["model"]
    assert m["d2h_gbps"] == 55.0 and m["d2d_gbps"] <= 2500 and m["step_ms"] == 29.54
    assert m["state_gb"] == 1.49
    staged, direct = out["b_staged"], out["b"]
    # the whole state went through the device buffer (within the allocator's rounding)
    assert abs(staged["staged_bytes_modelled"] / 1.49e9 - 1) < 0.05, staged
    assert direct["staged_bytes_modelled"] == 0, direct
    assert out["every_step_ratio"] == staged["ratio"]
    assert out["every_step_ratio_direct"] == direct["ratio"]
    assert out["budget_ratio"] == out["b_budget_direct"]["ratio"]
    assert out["budget_ratio_staged"] == out["b_budget"]["ratio"]
    assert direct["ideal_ratio"] > 1.0  # 1.49 GB at 55 GB/s is longer than the 25 ms window
    c = out["budget"]
    assert c["budget"] == 0.01 and not c["fixed"] and 1 <= c["k"] <= 64, c
    for bb in (out["b_budget"], out["b_budget_direct"]):
        assert bb["boundaries"] // 64 <= bb["snapshots"] <= bb["boundaries"], bb  # it copied
    for row in out["a"]:
        assert row["pinned_vs_link"] <= 1.02 and row["dma_vs_link"] <= 1.02, row  # never faster
    bars = [
        (1.0 <= out["complete_over_dma"] <= 1.10, f"complete_over_dma {out['complete_over_dma']}"),
        (staged["ratio"] <= 1.05, f"every step with staging {staged['ratio']}"),
        # the control: copied straight to the host, a 27 ms copy stalls a 29.5 ms step
        (direct["ratio"] >= 1.03, f"every step direct {direct['ratio']} (control)"),
        (out["budget_ratio"] <= 1.015, f"budget, defaults {out['budget_ratio']}"),
        (out["budget_ratio_staged"] <= 1.015, f"budget, staging {out['budget_ratio_staged']}"),
        (c["overhead"] is not None and c["overhead"] <= 0.015, f"budget's own measure {c}"),
    ]
    for row in out["a"]:
        mib = row["mib_modelled"]
        bars.append((row["complete_vs_link"] <= row["dma_vs_link"] * 1.02,  # after the DMA
                     f"{mib} MiB: COMPLETE {row['complete_vs_link']} vs DMA {row['dma_vs_link']}"))
        if mib >= 4096:  # 78 ms modelled: a loaded host cannot halve it
            bars.append((row["pinned_vs_link"] >= 0.5, f"4 GiB pinned {row['pinned_vs_link']}"))
    return out, [why for ok, why in bars if not ok]


def _busy_s() -> tuple[float, int]:
    """CPU seconds every process of the machine has used so far (steal included: another
    VM's use of these cores), and the number of cores (/proc/stat)."""
    lines = Path("/proc/stat").read_text().splitlines()
    f = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    cores = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK"), cores


def _others_share(run: Any) -> tuple[Any, float]:
    """``run()``'s result and the share of the machine's cores that processes other than
    this one and its children (a second ``make test``, another VM) used meanwhile."""
    t0, (b0, cores), c0 = time.monotonic(), _busy_s(), os.times()
    got = run()
    wall, (b1, _), c1 = time.monotonic() - t0, _busy_s(), os.times()
    mine = sum(c1[:4]) - sum(c0[:4])  # user + system, of this process and its children
    return got, max(0.0, (b1 - b0 - mine) / (wall * max(1, cores)))


LOADED = 0.2  # other processes used over a fifth of the cores: the ratios say nothing


def test_bench_timing_model_holds_issue_34s_figures(emu: Any) -> None:
    """``--emulated --timing h200`` (bench/modelled.py), issue 34's bar on the timing model:
    a snapshot is COMPLETE within 1.1x its DMA time (checksums keep pace with the copy);
    with device staging a GPT-2-small-sized state (1.49 GB, 29.5 ms step) snapshotted
    every step costs <= 5% (the direct D2H copy, longer than the forward/backward
    window, stalls the step: its control); the default 1% budget costs <= 1.5%, without
    staging (the library's defaults) and with it. The JSON says it is modelled and
    carries the model's calibration.

    The model runs host work for real: on a loaded host (a second ``make test`` beside
    this one) a run's host work can outlast its modelled time and a ratio then says
    nothing of the mechanism (the budget, measuring a noisy step, moves k and may end a
    run before it measured the new one). So the bars must all hold in one of three runs
    (each run's shape is asserted every time); a mechanism that misses them misses them in
    every run. A run that missed while other processes used over ``LOADED`` of the cores
    (/proc/stat, less this process's own) is no evidence either way: when every run was
    such, the bars are not judged (a skip that says so, with the figures)."""
    misses, quiet_miss = [], False
    for _ in range(3):
        (_, missed), others = _others_share(_modelled_run)
        if not missed:
            return
        misses.append((f"others {others:.0%}", missed))
        quiet_miss = quiet_miss or others <= LOADED
    if quiet_miss:
        raise AssertionError(f"the timing bars were missed in each of 3 runs: {misses}")
    pytest.skip(f"other processes used over {LOADED:.0%} of the cores in each run, and each "
                f"missed a timing bar: not judged on a loaded host ({misses})")
