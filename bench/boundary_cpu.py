"""Median ``boundary()`` time vs tensor count on the CPU backend (issue 15 target 2).

Small tensors (the cost under test is per tensor, not per byte): AdamW state of
``n/4`` parameters gives ``n`` state tensors. ``opt.step()`` runs between
boundaries (so the fence hook runs and the copy of the previous boundary is done).
The arena is made ready before timing: its set-up is issue 15 target 1, not this.

What the boundary right after ``opt.step()`` also pays (measured 2026-12-03, loaded VM):
glibc's malloc_consolidate of the small blocks the optimizer step freed, run by the
first >= 1 KB allocation after it (``torch.get_rng_state`` here): 0.2-0.4 ms alone,
0.6-1.3 ms of the 4,000-tensor median (``GLIBC_TUNABLES=glibc.malloc.mxfast=0``
removes it), and cold caches after the step; neither is boundary()'s own work.

The first boundary (the layout build) is timed apart (``first_ms``), not in the median.
``--restart``: the Snapshotter restores a previous attempt's snapshot first (a restart).

Baseline: the first tensor count (8 by default) in the same run. ``x base`` is
each median over its median: an O(1) boundary keeps it near 1 at any count.
``--repeats`` reruns the whole sweep (the machine is noisy: compare medians).

``alloc_after_step_us``: a separate loop without cudasnap timing the first 4 KB
allocation after ``opt.step()`` (the consolidation above, paid by whatever allocates
first; since the boundary writes its manifest text through a reused native buffer
it is no longer the boundary).

``--spin`` (diagnostic): wait for each copy by polling instead of sleeping in the
fence. A training thread that slept while the copy ran (the fence in ``opt.step()``)
comes back to caches other work has filled: most of the 4,000-tensor median is
that (constant native work, e.g. comparing 8 KB of RNG state, costs 5-10x more
then), not boundary()'s own work.

``--first N``: only the first boundary, of N fresh Snapshotters per tensor count over
the same state, each timed right after its constructor (the arena set-up then runs
beside it): median, max and how many took over 5 ms of wall time, with their thread CPU.
With ``--no-prestart`` as well, the same with ``Layouts.prestart`` turned off (the
build's thread then started inside that boundary, as before d20e052), alternating with
the default in the same process: both under the same load.

``--against DIR``: before/after in one session: every (repeat, tensor count) runs
twice, alternating, in a fresh process: once with ``PYTHONPATH=DIR`` (e.g. a
checkout of main with its extension built) and once with this tree; the table
gives both medians and after/before ratios of wall and thread CPU time.

    python bench/boundary_cpu.py [--tensors 8,4000,40000] [--boundaries 200] [--every 1]
                                 [--repeats 1] [--against DIR] [--spin]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# Every boundary copies (what these figures measure): the default overhead budget would
# skip boundaries once it has measured the cost (cudasnap.core.cadence). Old trees ignore it.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")


def adam_state(ntensors: int) -> tuple[Any, Any]:
    """``ntensors`` state tensors: AdamW over ``ntensors / 4`` small parameters, stepped once."""
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(max(1, ntensors // 4))]
    model = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def _running_job(snap: Any) -> Any:
    """The copy in flight (None: none): the Copier's; a tree from before issue 24 (run by
    --against) kept it on the Snapshotter."""
    copier = getattr(snap, "_copier", None)
    return copier.job if copier is not None else getattr(snap, "_job", None)


def _set_rescan_every(snap: Any, n: int) -> None:
    """Boundaries between two full re-scans of the state: the Layouts' setting; a tree from
    before issue 24 kept it on the Snapshotter (``RESCAN_EVERY``)."""
    layouts = getattr(snap, "_layouts", None)
    if layouts is not None and hasattr(layouts, "rescan_every"):
        layouts.rescan_every = n
    else:
        snap.RESCAN_EVERY = n


def run(ntensors: int, boundaries: int, every: int, spin: bool = False,
        rescan_every: int | None = None, restart: bool = False) -> dict[str, Any]:
    import cudasnap

    model, opt = adam_state(ntensors)
    with tempfile.TemporaryDirectory() as d:
        kw: dict[str, Any] = {"snapshot_every": every} if every != 1 else {}
        job = f"bb-{os.getpid()}-{ntensors}"
        start = 0
        if restart:  # --restart: a previous attempt left step 0 in shared memory
            prev = cudasnap.Snapshotter(model, opt, directory=d, job=job, health=False,
                                        flush_on_close=False, **kw)
            prev.boundary(0)
            prev.wait()
            prev.close(keep_arena=True)
        snap = cudasnap.Snapshotter(model, opt, directory=d, job=job,
                                    health=False, flush_on_close=False, **kw)
        if restart:
            start = snap.restore_latest()
        if rescan_every is not None:  # --rescan-every: the periodic re-scan K x as often
            _set_rescan_every(snap, rescan_every)
        # The first boundary builds the layout (tensor table, copy plan) on the training
        # thread: timed on its own (issue 26: no boundary over 5 ms, the first included).
        # Its Python allocations may also reach a full GC pass of the process.
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        snap.boundary(start)
        first_ns, first_cpu_ns = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
        snap.wait()
        snap.arena_ready()  # large arenas are set up in the background (target 1)
        ts, cpu = [], []
        for step in range(start + 1, start + boundaries + 1):
            cjob = _running_job(snap)
            while spin and cjob is not None and not cjob.done(1):
                pass  # --spin: the training thread never sleeps (its caches stay warm)
            opt.step()
            snap.wait()  # the copy cost is not under test, only the blocked time
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            snap.boundary(step)
            ts.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
        snap.wait()
        st = snap.stats()
        snap.close()
    alloc = []
    for _ in range(min(boundaries, 60)):
        opt.step()
        t0 = time.perf_counter_ns()
        bytearray(4096)
        alloc.append(time.perf_counter_ns() - t0)
    return {"alloc_after_step_us": statistics.median(alloc) / 1e3, "from": cudasnap.__file__,
            "tensors": ntensors, "median_ms": statistics.median(ts) / 1e6,
            "p90_ms": sorted(ts)[int(len(ts) * 0.9)] / 1e6,
            # The slowest boundary and its thread CPU (a periodic full re-scan of the
            # state runs every rescan_every x ceil(n / 1024) boundaries: 256 at 4,000).
            "max_ms": max(ts) / 1e6, "max_cpu_ms": cpu[ts.index(max(ts))] / 1e6,
            "over_5ms": sum(t > 5e6 for t in ts),
            "over_5ms_cpu": sum(c > 5e6 for c in cpu), "max_cpu_any_ms": max(cpu) / 1e6,
            # CPU time of the training thread: what boundary() costs, without the
            # preemption a loaded host adds to the wall time.
            "cpu_median_ms": statistics.median(cpu) / 1e6, "snapshots": st["snapshots"],
            "first_ms": first_ns / 1e6, "first_cpu_ms": first_cpu_ns / 1e6,
            "layout_rebuilds": st["layout_rebuilds"]}


def _one(path: str, n: int, a: argparse.Namespace) -> dict[str, Any]:
    """One tensor count in a fresh process importing cudasnap from ``path``."""
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--tensors", str(n),
                          "--boundaries", str(a.boundaries), "--every", str(a.every), "--json",
                          *(["--spin"] if a.spin else [])],
                         env=env, check=True, capture_output=True, text=True, cwd=path).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(a: argparse.Namespace) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rep in range(a.repeats):
        for n in [int(x) for x in a.tensors.split(",")]:
            before = _one(os.path.abspath(a.against), n, a)  # alternating, same session
            after = _one(here, n, a)
            assert before["from"] != after["from"], before["from"]
            r = {"repeat": rep, "tensors": n, "load": os.getloadavg()[0],
                 "before_ms": before["median_ms"], "after_ms": after["median_ms"],
                 "ratio": after["median_ms"] / before["median_ms"],
                 "before_cpu_ms": before["cpu_median_ms"], "after_cpu_ms": after["cpu_median_ms"],
                 "cpu_ratio": after["cpu_median_ms"] / before["cpu_median_ms"],
                 "alloc_after_step_us": after["alloc_after_step_us"]}
            print(json.dumps(r) if a.json else
                  f"rep {rep} {n:>6} tensors (load {r['load']:.1f}): wall median before "
                  f"{r['before_ms']:.3f} / after {r['after_ms']:.3f} ms = {r['ratio']:.2f}x; "
                  f"thread CPU {r['before_cpu_ms']:.3f} / {r['after_cpu_ms']:.3f} ms = "
                  f"{r['cpu_ratio']:.2f}x; 4 KB malloc after opt.step "
                  f"{r['alloc_after_step_us']:.0f} us", flush=True)


def first_only(ntensors: int, trials: int, compare_no_prestart: bool) -> dict[str, Any]:
    """``--first``: the first boundary of ``trials`` fresh Snapshotters (see the docstring);
    {mode: {"wall_ms": [...], "cpu_ms": [...]}} for "prestart" (and "no_prestart")."""
    import cudasnap
    try:
        from cudasnap.core.plan_cache import Layouts
    except ImportError:  # a tree before issue 36 (--against)
        from cudasnap.core.copy_plan import Layouts  # type: ignore[attr-defined,no-redef]

    model, opt = adam_state(ntensors)
    modes = ["prestart", "no_prestart"] if compare_no_prestart else ["prestart"]
    out: dict[str, Any] = {m: {"wall_ms": [], "cpu_ms": []} for m in modes}
    real = Layouts.prestart
    for i in range(trials):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            Layouts.prestart = real if mode == "prestart" else (lambda self: None)  # type: ignore[method-assign]
            try:
                with tempfile.TemporaryDirectory() as d:
                    snap = cudasnap.Snapshotter(model, opt, directory=d, health=False,
                                                job=f"bbf-{os.getpid()}-{ntensors}-{i}-{mode}",
                                                flush_on_close=False)
                    try:
                        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                        snap.boundary(0)
                        out[mode]["wall_ms"].append((time.perf_counter_ns() - t0) / 1e6)
                        out[mode]["cpu_ms"].append((time.thread_time_ns() - c0) / 1e6)
                        snap.wait()
                    finally:
                        snap.close(flush=False)
            finally:
                Layouts.prestart = real  # type: ignore[method-assign]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="8,4000,40000")
    p.add_argument("--boundaries", type=int, default=200)
    p.add_argument("--every", type=int, default=1, help="snapshot_every (k)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--spin", action="store_true",
                   help="diagnostic: wait for each copy by polling, not sleeping (a thread "
                        "that slept in the fence comes back to cold caches)")
    p.add_argument("--against", help="a tree to compare with (before/after, alternating)")
    p.add_argument("--rescan-every", type=int, default=None,
                   help="the layouts' rescan_every (default 64: a re-scan every 64 x "
                        "ceil(n/1024) boundaries); 1 runs the periodic re-scan of the state "
                        "often enough to be timed (it is spread over boundaries in pieces)")
    p.add_argument("--restart", action="store_true",
                   help="time the boundaries after a restore_latest() of a previous attempt's "
                        "snapshot (a restart), the first one included")
    p.add_argument("--first", type=int, default=0, metavar="N",
                   help="only the first boundary, of N fresh Snapshotters per tensor count")
    p.add_argument("--no-prestart", action="store_true",
                   help="with --first: also time it without Layouts.prestart, alternating")
    a = p.parse_args(argv)
    if a.first:
        for n in [int(x) for x in a.tensors.split(",")]:
            res = first_only(n, a.first, a.no_prestart)
            for mode, r in res.items():
                w, c = r["wall_ms"], r["cpu_ms"]
                over = sum(x > 5.0 for x in w)
                print(json.dumps({"tensors": n, "mode": mode, **r}) if a.json else
                      f"{n:>6} tensors, first boundary, {mode}: median {statistics.median(w):.2f} ms, "
                      f"max {max(w):.2f} ms (its CPU {c[w.index(max(w))]:.2f}), {over} of {len(w)} "
                      f"over 5 ms; thread CPU median {statistics.median(c):.2f} ms", flush=True)
        return
    if a.against:
        compare(a)
        return
    for rep in range(a.repeats):
        base = None
        for n in [int(x) for x in a.tensors.split(",")]:
            r = run(n, a.boundaries, a.every, a.spin, a.rescan_every, a.restart)
            base = base or r
            r["repeat"] = rep
            r["x_base"] = r["median_ms"] / base["median_ms"]
            r["cpu_x_base"] = r["cpu_median_ms"] / base["cpu_median_ms"]
            print(json.dumps(r) if a.json else
                  f"{r['tensors']:>6} tensors: boundary median {r['median_ms']:.3f} ms "
                  f"({r['x_base']:.2f}x base), p90 {r['p90_ms']:.3f} ms, max {r['max_ms']:.2f} ms "
                  f"(its CPU {r['max_cpu_ms']:.2f}; {r['over_5ms']} over 5 ms; max thread CPU "
                  f"{r['max_cpu_any_ms']:.2f} ms, {r['over_5ms_cpu']} over 5 ms), thread CPU median "
                  f"{r['cpu_median_ms']:.3f} ms ({r['cpu_x_base']:.2f}x base) "
                  f"({r['snapshots']} snapshots, {r['layout_rebuilds']} layout builds); "
                  f"first boundary {r['first_ms']:.2f} ms (its CPU {r['first_cpu_ms']:.2f})",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
