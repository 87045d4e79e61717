"""Where ``boundary()``'s host time goes on the CUDA path: cProfile over N boundaries.

Runs on a GPU or under the emulated CUDA runtime (absolute times there are the emulator's:
each runtime call is a mutex and a thread wake-up, so only the split between the parts is
meaningful). ``wait()`` runs between boundaries, untimed: the plan is cached, each
boundary submits one copy.

    tools/cudaemu/run.sh .venv/bin/python bench/boundary_profile.py [--tensors 1000] [--boundaries 200]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--boundaries", type=int, default=200)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--overhead-budget", type=float, default=0.0,
                    help="the Snapshotter's overhead_budget (default 0: every boundary copies; "
                         "0.01: the default, which skips boundaries once it has measured)")
    a = ap.parse_args(argv)
    import torch

    import cudasnap

    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(a.numel, device="cuda"))
                                     for _ in range(a.tensors))
    snap = cudasnap.Snapshotter(model, None, directory=tempfile.mkdtemp(), job="bprof",
                                health=False, overhead_budget=a.overhead_budget)
    try:
        for i in range(20):  # the layout, the arena, the first copies
            snap.boundary(i)
            snap.wait(60)
        plain, prof = [], cProfile.Profile()
        for i in range(20, 20 + a.boundaries):
            t0 = time.perf_counter_ns()
            snap.boundary(i)
            plain.append((time.perf_counter_ns() - t0) / 1e3)
            snap.wait(60)
        for i in range(20 + a.boundaries, 20 + 2 * a.boundaries):
            prof.enable()
            snap.boundary(i)
            prof.disable()
            snap.wait(60)
    finally:
        snap.close()
    plain.sort()
    print(f"boundary() host time at {a.tensors} tensors: median {statistics.median(plain):.1f} us, "
          f"p90 {plain[int(len(plain) * 0.9)]:.1f} us (unprofiled)")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
