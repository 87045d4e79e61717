"""A restore from disk, timed here and (``--against TREE``) in another tree, alternating.

The restore path alone (``Snapshotter.restore_dir`` of a committed step, the CPU backend):
a state of ``--tensors`` tensors (AdamW: params and two moments) is flushed once, then
restored ``--restores`` times in the same process; the median wall time and the Python calls
per restore (cProfile) are printed as JSON, with the ratio against the other tree when given.
Equal call counts and a ratio near 1 say a refactor left the restore's work unchanged; the
wall times on a shared 2-core VM vary by tens of percent from run to run.

    PYTHONPATH=. python bench/restore_ab.py --against /path/to/before-tree
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time


def one(tensors: int, restores: int) -> dict[str, float]:
    import torch

    import cudasnap

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6250)) for _ in range(max(1, tensors // 4))]
    model = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    directory = tempfile.mkdtemp(dir="/var/tmp", prefix="restore-ab-")
    os.environ["CUDASNAP_JOB"] = f"restore-ab-{os.getpid()}"
    snap = cudasnap.Snapshotter(model, opt, directory=directory, backend="cpu", health=False,
                                flush_on_close=False)
    try:
        snap.boundary(0)
        snap.wait()
        path = snap.flush()
        assert path is not None
        for _ in range(3):  # warm: page cache, allocator
            snap.restore_dir(path)
        times, prof = [], cProfile.Profile()
        for _ in range(restores):
            t = time.perf_counter()
            prof.enable()
            snap.restore_dir(path)
            prof.disable()
            times.append(time.perf_counter() - t)
    finally:
        snap.close(keep_arena=False)
    calls = pstats.Stats(prof).total_calls / restores  # type: ignore[attr-defined]
    return {"median_s": statistics.median(times), "calls_per_restore": calls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--restores", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    ap.add_argument("--against", help="another tree (its cudasnap built) to compare with")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one or not a.against:
        print(json.dumps(one(a.tensors, a.restores)))
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
    for i in range(a.rounds):
        order = [("after", here), ("before", a.against)]
        for name, tree in order if i % 2 == 0 else order[::-1]:
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                                  "--tensors", str(a.tensors), "--restores", str(a.restores)],
                                 cwd=tree, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r["median_s"] for r in v) for k, v in runs.items()}
    print(json.dumps({"tensors": a.tensors, "restores": a.restores, "runs": runs,
                      "after_s": med["after"], "before_s": med["before"],
                      "ratio": med["after"] / med["before"],
                      "calls_after": runs["after"][0]["calls_per_restore"],
                      "calls_before": runs["before"][0]["calls_per_restore"],
                      "load": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
