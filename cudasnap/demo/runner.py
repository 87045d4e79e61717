"""``cudasnap demo``: a training run that survives an injected failure and resumes bit for bit.

1. A reference run trains N steps without interruption.
2. The same job runs under ``cudasnap run`` (the supervisor) with a fault at
   step F: by default the process SIGKILLs itself in the middle of iteration F
   (after backward, before the optimizer step); ``--fault`` injects a health
   signal instead (xid=79, ecc_dbe, gpu_lost, hang, sigterm), which goes
   through the real policy, flush and exit code.
3. The supervisor flushes the newest COMPLETE shared-memory slot, restarts the
   job, which restores (shared memory first, then disk) and finishes.
4. The final parameters, optimizer state and RNG state are compared byte for byte.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..storage import listing
from ..supervisor.loop import supervise

FAULTS = {
    "kill": None, "xid": "xid=79@step={f}", "ecc_dbe": "ecc_dbe@step={f}",
    "gpu_lost": "gpu_lost@step={f}", "hang": "hang@step={f}", "sigterm": "sigterm@step={f}",
}


def _compare(a: Path, b: Path) -> tuple[bool, str]:
    with np.load(a, allow_pickle=False) as x, np.load(b, allow_pickle=False) as y:
        if set(x.files) != set(y.files):
            return False, f"different tensors: {sorted(set(x.files) ^ set(y.files))[:3]}"
        for k in sorted(x.files):
            u, v = x[k], y[k]
            if u.shape != v.shape or u.dtype != v.dtype or u.tobytes() != v.tobytes():
                return False, f"{k} differs"
    return True, f"{len(x.files)} arrays identical"


def run_demo(steps: int = 40, fail_at: int = 23, fault: str = "kill", workdir: Path | None = None,
             device: str = "cpu", hidden: int = 1024, layers: int = 4) -> dict[str, Any]:
    if fault not in FAULTS:
        raise SystemExit(f"--fault must be one of {', '.join(FAULTS)}")
    if not 0 < fail_at < steps:
        raise SystemExit(f"--fail-at must be in 1..{steps - 1}")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="cudasnap-demo-"))
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    common = ["--steps", str(steps), "--device", device, "--hidden", str(hidden),
              "--layers", str(layers)]
    import subprocess

    for f in ("ref.npz", "run.npz", "stats.jsonl"):
        (work / f).unlink(missing_ok=True)
    t0 = time.time()
    subprocess.run([py, "-m", "cudasnap.demo.train", *common, "--no-snapshot",
                    "--out", str(work / "ref.npz"), "--stats", str(work / "ref-stats.jsonl")],
                   check=True)
    t_ref = time.time() - t0
    report: list[dict[str, Any]] = []
    spec = FAULTS[fault]
    cmd = [py, "-m", "cudasnap.demo.train", *common, "--out", str(work / "run.npz"),
           "--stats", str(work / "stats.jsonl")]
    if spec is None:
        cmd += ["--fail-at", str(fail_at)]
    t0 = time.time()
    rc = supervise(cmd, work / "ckpt", max_restarts=1,
                   inject_first=spec.format(f=fail_at) if spec else None,
                   watchdog_s=3.0 if fault == "hang" else None, report=report)
    t_run = time.time() - t0
    if rc != 0:
        raise SystemExit(f"the supervised run failed ({rc}); see the log above")
    recs = [json.loads(line) for line in (work / "stats.jsonl").read_text().splitlines()]
    final = recs[-1]
    same, why = _compare(work / "ref.npz", work / "run.npz")
    resumed_at = int(final["start"])
    flushes = listing.read_flush_log(work / "ckpt")
    died = report[0]["died"] if report else None
    restore = final.get("restore") or {}
    out = {
        "fault": fault, "failure_step": fail_at, "resumed_at": resumed_at,
        # Steps that had completed before the fault and had to be computed again:
        # kill/hang strike inside step F (F-1 was the last complete one); the
        # health faults are injected at the boundary after step F.
        # (negative would mean the fault was seen a step later than injected: 0 lost.)
        "replayed_steps": max(0, (fail_at - 1 if fault in ("kill", "hang") else fail_at) + 1
                              - resumed_at),
        "bitwise_identical": same, "compare": why,
        "exit": report[0]["exit"] if report else None,
        "snapshot_bytes": final.get("bytes"),
        "boundary_stall_us_median": final.get("boundary_us_median"),
        "fence_wait_s": final.get("fence_wait_s"),
        "flush_seconds": flushes[0]["seconds"] if flushes else None,
        "restore_seconds": restore.get("seconds"), "restore_source": restore.get("source"),
        "recovery_seconds": (final["t_first_step"] - died) if died and final.get("t_first_step")
        else None,
        "recovery_parts": recovery_parts(report, final),
        "warm_restart": bool(len(report) > 1 and report[1].get("warm")),
        "reference_seconds": t_ref, "protected_seconds": t_run, "workdir": str(work),
    }
    return out


def recovery_parts(report: list[dict[str, Any]], rec: dict[str, Any]) -> dict[str, float] | None:
    """Death -> first resumed step, split at the timestamps the supervisor (died, flush,
    restart) and the resumed process (exec, script start, torch imported, cudasnap
    imported, restored, first step) recorded."""
    if len(report) < 2 or rec.get("t_first_step") is None:
        return None
    died, restarted = report[0]["died"], report[1]["started"]
    warm = bool(rec.get("warm"))  # a standby had the interpreter and imports ready
    marks = [("exit -> restart (supervisor)", restarted),
             ("interpreter start", None if warm else rec.get("t_exec")),
             ("warm standby -> script top" if warm else "python + numpy (script top)",
              rec.get("t_script")),
             ("import torch", rec.get("t_torch")),
             ("import cudasnap", rec.get("t_cudasnap")),
             ("build model + optimizer", rec.get("t_start")),
             ("Snapshotter + restore_latest", rec.get("t_restored")),
             ("first resumed step", rec.get("t_first_step"))]
    parts: dict[str, float] = {}
    prev = died
    for name, t in marks:
        if t is None:
            continue
        parts[name] = max(0.0, t - prev)  # exec time has 10 ms resolution
        prev = max(prev, t)
    parts["total"] = rec["t_first_step"] - died
    flush = report[0]
    if "flush_start" in flush and "flush_done" in flush:
        parts["(of which supervisor flush)"] = flush["flush_done"] - flush["flush_start"]
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cudasnap demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fail-at", type=int, default=23)
    p.add_argument("--fault", default="kill", choices=sorted(FAULTS))
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    device = a.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    r = run_demo(a.steps, a.fail_at, a.fault, a.workdir, device, a.hidden, a.layers)
    ok = r["bitwise_identical"] and r["replayed_steps"] <= 1

    def fmt(v: Any, unit: str = "", scale: float = 1.0) -> str:
        return "n/a" if v is None else f"{v * scale:.3f}{unit}"

    lines = [
        "cudasnap demo",
        f"  fault             : {r['fault']} at step {r['failure_step']} -> {r['exit']}",
        f"  resumed at        : step {r['resumed_at']} from {r['restore_source']} "
        f"(replayed {r['replayed_steps']} step(s))",
        f"  bitwise identical : {r['bitwise_identical']} ({r['compare']})",
        f"  snapshot          : {fmt(r['snapshot_bytes'], ' MB', 1e-6)} per step",
        f"  boundary() median : {fmt(r['boundary_stall_us_median'], ' us')}",
        f"  flush to disk     : {fmt(r['flush_seconds'], ' s')}",
        f"  restore           : {fmt(r['restore_seconds'], ' s')}",
        f"  death -> resumed  : {fmt(r['recovery_seconds'], ' s')} "
        f"({'warm standby' if r['warm_restart'] else 'cold start'})",
        f"  result            : {'PASS' if ok else 'FAIL'}",
    ]
    parts = r.get("recovery_parts") or {}
    lines[-1:-1] = [f"      {k:<30}: {v:.3f} s" for k, v in parts.items() if k != "total"]
    print("\n".join(lines))
    if a.json:
        print(json.dumps(r))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
