"""The unprotected start of an attempt, by state size (issue 23 item 2).

Window = Snapshotter construction -> the first boundary whose snapshot is in the
staging arena (COMPLETE: a SIGKILL after it loses at most one step). Boundaries
before it are skipped (``stats()["skipped_not_ready"]``): the arena is still being
set up (fresh attempt) or warmed (restart: the predecessor's arena is adopted).

Each trial runs in a fresh process:

* ``fresh``: no arena in /dev/shm; the Snapshotter is built, then the loop starts at
  once (``--warmup-ms`` of data-loader / model warm-up in between: default 0, the
  worst case);
* ``restart``: a first process leaves its arena (with a snapshot), exits; the measured
  process restores from it and trains on.

The loop is an AdamW step with gradients present (its cost scales with the state:
a real step costs more, which only shortens the window in boundaries) plus
``--step-ms`` of extra matmul work per step. Printed: the median (and range) over
``--repeats`` of the window in seconds and in boundaries, and whether the
goal (<= 2 boundaries below 1 GB) holds.

    python bench/start_window.py [--sizes-mb 40,400] [--repeats 3] [--step-ms 0]
                                 [--warmup-ms 0] [--modes fresh,restart] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from _common import build_state, machine_line, med, print_table  # noqa: E402

# Every boundary copies (what these figures measure): the default overhead budget would
# skip boundaries once it has measured the cost (cudasnap.core.cadence). Old trees ignore it.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")


def _model(size_mb: float) -> tuple[Any, Any]:
    import torch

    model, opt = build_state(size_mb / 1000, 8)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-4)
    return model, opt


def _busy(ms: float, x: Any) -> None:
    if ms <= 0:
        return
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        x @ x


def trial(size_mb: float, mode: str, directory: str, job: str, step_ms: float,
          warmup_ms: float, max_steps: int) -> dict[str, Any]:
    """One measured attempt (this process)."""
    import torch

    import cudasnap

    model, opt = _model(size_mb)
    x = torch.randn(256, 256)
    t0 = time.perf_counter()
    snap = cudasnap.Snapshotter(model, opt, directory=directory, job=job, health=False)
    t_built = time.perf_counter() - t0
    start = 0
    if mode == "restart":
        start = snap.restore_latest() + 1
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-4)
    _busy(warmup_ms, x)
    first = None
    steps = 0
    step_times = []
    for step in range(start, start + max_steps):
        ts = time.perf_counter()
        opt.step()
        _busy(step_ms, x)
        before = snap.stats()["snapshots"]
        snap.boundary(step)
        steps += 1
        step_times.append(time.perf_counter() - ts)
        if first is None and snap.stats()["snapshots"] > before:
            snap.wait(120)
            first = {"step": step, "seconds": time.perf_counter() - t0,
                     "boundaries_before": steps - 1}
            if steps >= 3:
                break
        if first is not None and steps >= 3:
            break
    st = snap.stats()
    snap.close(keep_arena=mode == "leave", flush=False)
    nbytes = st["bytes"]
    step_times.sort()
    return {"mode": mode, "size_mb": size_mb, "state_bytes": nbytes,
            "construct_s": t_built, "window_s": first["seconds"] if first else None,
            "window_boundaries": first["boundaries_before"] if first else None,
            "first_protected_step": first["step"] if first else None,
            "skipped_not_ready": st["skipped_not_ready"],
            "step_ms": step_times[len(step_times) // 2] * 1e3,
            "arena_setup_s": st["arena_setup_seconds"]}


def _run_one(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(HERE), "--one", *args], check=True,
                         capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="40,400")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--warmup-ms", type=float, default=0.0)
    p.add_argument("--modes", default="fresh,restart")
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", nargs=5, metavar=("SIZE_MB", "MODE", "DIR", "JOB", "MAX_STEPS"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        size, mode, d, job, n = a.one
        r = trial(float(size), mode, d, job, a.step_ms, a.warmup_ms, int(n))
        print(json.dumps(r), flush=True)
        return 0
    common = ["--step-ms", str(a.step_ms), "--warmup-ms", str(a.warmup_ms)]
    results: list[dict[str, Any]] = []
    for size in [float(s) for s in a.sizes_mb.split(",")]:
        for mode in a.modes.split(","):
            for rep in range(a.repeats):
                job = f"sw-{os.getpid()}-{uuid.uuid4().hex[:6]}"
                with tempfile.TemporaryDirectory() as d:
                    try:
                        if mode == "restart":  # a predecessor leaves its arena (a snapshot)
                            _run_one([str(size), "leave", d, job, "5"] + common)
                        r = _run_one([str(size), mode, d, job, str(a.max_steps)] + common)
                    finally:
                        for f in Path("/dev/shm").glob(f"cudasnap-{job}*"):
                            f.unlink(missing_ok=True)
                r["repeat"] = rep
                r["load"] = os.getloadavg()[0]
                results.append(r)
                if a.json:
                    print(json.dumps(r), flush=True)
    rows = []
    for size in sorted({r["size_mb"] for r in results}):
        for mode in a.modes.split(","):
            rs = [r for r in results if r["size_mb"] == size and r["mode"] == mode]
            if not rs:
                continue
            ws = [r["window_s"] for r in rs if r["window_s"] is not None]
            bs = [r["window_boundaries"] for r in rs if r["window_boundaries"] is not None]
            goal = size < 1000 and bool(bs) and len(bs) == len(rs) and max(bs) <= 2
            rows.append([f"{rs[0]['state_bytes'] / 1e6:.0f} MB", mode,
                         f"{med(ws):.2f} ({min(ws):.2f}-{max(ws):.2f})" if ws else "never",
                         f"{med(bs):g} ({min(bs)}-{max(bs)})" if bs else "-",
                         f"{med([r['step_ms'] for r in rs]):.0f}",
                         f"{med([r['construct_s'] for r in rs]):.2f}",
                         "yes" if goal else ("n/a" if size >= 1000 else "NO")])
    print_table("Start window: construction -> first protected step",
                ["state", "attempt", "window s, median (range)",
                 "boundaries skipped, median (range)", "step ms", "construct s",
                 "<= 2 boundaries"], rows,
                note=f"{a.repeats} trial(s) each, --step-ms {a.step_ms}, --warmup-ms "
                     f"{a.warmup_ms}; {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
