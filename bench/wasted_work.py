"""Wasted GPU time of periodic (Young/Daly) vs JIT checkpointing as the job grows.

Prints, for N = 8 ... 131,072 GPUs, the expected wasted fraction of both
policies (exact-for-exponential closed form, see ``cudasnap.modelling.analysis``), their
ratio, wasted GPU-hours per day, and a seeded Monte-Carlo check (95% CI) for a
few N; then a short reading, and saves ``bench/wasted_work.png``.

Defaults: the Llama 3 per-GPU failure rate (419 interruptions / 54 days /
16,384 GPUs), 8 s iterations, 60 GB of state per GPU (C = 30 s at 2 GB/s,
F = 60 s at 1 GB/s), R = 300 s, D = 60 s, no JIT steady-state overhead.
Plug measured figures in with ``--c-seconds --f-seconds --r-seconds
--d-seconds --jit-overhead``.

    python bench/wasted_work.py [--preset kokolis] [--c-seconds 12] ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cudasnap.modelling.analysis import (  # noqa: E402
    DEFAULT_CHECKPOINT_GBPS,
    DEFAULT_DETECT_SECONDS,
    DEFAULT_FLUSH_GBPS,
    DEFAULT_JIT_OVERHEAD,
    DEFAULT_RESTART_SECONDS,
    Scenario,
    compare,
    jit_waste,
    periodic_waste,
)
from cudasnap.modelling.presets import PRESETS  # noqa: E402
from cudasnap.modelling.simulate import simulate_waste  # noqa: E402

DEFAULT_GPUS = (8, 64, 512, 4096, 16384, 131072)
DEFAULT_MC_GPUS = (64, 4096, 131072)
DEFAULT_PNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wasted_work.png")


def _gh(x: float) -> str:
    """GPU-hours, readable: thousands separators for big values, 3 significant digits else."""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3",
                   help="per-GPU failure rate preset (default: llama3)")
    p.add_argument("--gpu-mtbf-hours", type=float, default=None,
                   help="per-GPU MTBF in hours (overrides --preset)")
    p.add_argument("--gpus", type=_int_list, default=list(DEFAULT_GPUS),
                   help="comma-separated job sizes")
    p.add_argument("--iter-seconds", type=float, default=8.0)
    p.add_argument("--state-gb", type=float, default=60.0, help="checkpoint state per GPU, GB")
    p.add_argument("--checkpoint-gbps", type=float, default=DEFAULT_CHECKPOINT_GBPS)
    p.add_argument("--flush-gbps", type=float, default=DEFAULT_FLUSH_GBPS)
    p.add_argument("--c-seconds", type=float, default=None,
                   help="periodic checkpoint stall C (default: state-gb / checkpoint-gbps)")
    p.add_argument("--f-seconds", type=float, default=None,
                   help="JIT flush time F (default: state-gb / flush-gbps)")
    p.add_argument("--r-seconds", type=float, default=DEFAULT_RESTART_SECONDS, help="restart cost R")
    p.add_argument("--d-seconds", type=float, default=DEFAULT_DETECT_SECONDS, help="detection time D")
    p.add_argument("--jit-overhead", type=float, default=DEFAULT_JIT_OVERHEAD,
                   help="JIT steady-state overhead, fraction of an iteration")
    p.add_argument("--mc-gpus", type=_int_list, default=list(DEFAULT_MC_GPUS),
                   help="job sizes that get a Monte-Carlo check ('' for none)")
    p.add_argument("--replications", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weibull-shape", type=float, default=None,
                   help="simulate per-GPU Weibull renewal failures of this shape instead of exponential")
    p.add_argument("--weibull-start", choices=("stationary", "fresh"), default="stationary")
    p.add_argument("--png", default=DEFAULT_PNG, help="output plot path")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def plot(path: str, base: Scenario, gpus: list[int], mc: dict[int, dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.unique(np.geomspace(1, max(gpus) * 2, 200).astype(int))
    per = [periodic_waste(base.with_gpus(int(n))) for n in grid]
    jit = [jit_waste(base.with_gpus(int(n))) for n in grid]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    ax.plot(grid, per, color="tab:red", label="periodic (Daly interval), closed form")
    ax.plot(grid, jit, color="tab:blue", label="JIT, closed form")
    ax.scatter(gpus, [periodic_waste(base.with_gpus(n)) for n in gpus], color="tab:red", s=14, zorder=3)
    ax.scatter(gpus, [jit_waste(base.with_gpus(n)) for n in gpus], color="tab:blue", s=14, zorder=3)
    for name, _color in (("periodic", "tab:red"), ("jit", "tab:blue")):
        xs = sorted(mc)
        if not xs:
            continue
        ys = [mc[n][name].mean for n in xs]
        err = [mc[n][name].half_width for n in xs]
        ax.errorbar(xs, ys, yerr=err, fmt="x", color="black", ms=7, capsize=3,
                    label="Monte-Carlo, 95% CI" if name == "periodic" else None, zorder=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs in the job (N)")
    ax.set_ylabel("expected wasted fraction of GPU time")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    a = parse_args(argv)
    preset = PRESETS[a.preset]
    gpu_mtbf_h = a.gpu_mtbf_hours if a.gpu_mtbf_hours is not None else preset.gpu_mtbf_hours
    c = a.c_seconds if a.c_seconds is not None else a.state_gb / a.checkpoint_gbps
    f = a.f_seconds if a.f_seconds is not None else a.state_gb / a.flush_gbps
    base = Scenario.from_hours(
        a.gpus[0], gpu_mtbf_h, a.iter_seconds, c, f,
        restart_s=a.r_seconds, detect_s=a.d_seconds, jit_overhead=a.jit_overhead,
    )
    src = "--gpu-mtbf-hours" if a.gpu_mtbf_hours is not None else preset.source
    print(f"per-GPU MTBF {gpu_mtbf_h:,.1f} h ({src})")
    print(f"T_it = {a.iter_seconds:g} s, C = {c:g} s, F = {f:g} s, R = {a.r_seconds:g} s, "
          f"D = {a.d_seconds:g} s, JIT overhead o = {a.jit_overhead:g}")
    dist = "exponential" if a.weibull_shape is None else (
        f"per-GPU Weibull k={a.weibull_shape:g} ({a.weibull_start})")
    print(f"closed form: exact for exponential (Daly); MC: {dist}, "
          f"{a.replications} replications x ~2000 failures, seed {a.seed}")
    print()
    hdr = (f"{'GPUs':>7} {'job MTBF h':>10} {'fail/day':>8} {'Daly tau':>9} "
           f"{'periodic %':>10} {'JIT %':>8} {'per/JIT':>8} {'per GPU-h/d':>11} {'JIT GPU-h/d':>11} "
           f"{'MC periodic % (95% CI)':>24} {'MC JIT % (95% CI)':>22}")
    print(hdr)
    print("-" * len(hdr))
    mc: dict[int, dict] = {}
    rows = []
    for n in a.gpus:
        s = base.with_gpus(n)
        r = compare(s)
        rows.append(r)
        mc_cols = ["", ""]
        if n in a.mc_gpus:
            kw = {} if a.weibull_shape is None else {
                "distribution": "weibull", "shape": a.weibull_shape, "start": a.weibull_start}
            sim = simulate_waste(s, replications=a.replications, seed=a.seed, **kw)
            mc[n] = sim
            for i, name in enumerate(("periodic", "jit")):
                x = sim[name]
                ok = "ok" if x.contains(r[name]["wasted_fraction"]) else "!!"
                mc_cols[i] = f"{100 * x.mean:.4g} ± {100 * x.half_width:.2g} {ok}"
        tau = r["periodic"]["interval_seconds"]
        tau_txt = f"{tau / 60:.1f} m" if tau < 3 * 3600 else f"{tau / 3600:.1f} h"
        print(f"{n:>7} {r['job_mtbf_hours']:>10.4g} {r['failures_per_day']:>8.3g} {tau_txt:>9} "
              f"{100 * r['periodic']['wasted_fraction']:>10.4g} {100 * r['jit']['wasted_fraction']:>8.4g} "
              f"{r['ratio_periodic_to_jit']:>8.3g} {_gh(r['periodic']['wasted_gpu_hours_per_day']):>11} "
              f"{_gh(r['jit']['wasted_gpu_hours_per_day']):>11} {mc_cols[0]:>24} {mc_cols[1]:>22}")
    print("(MC 'ok': the closed form lies inside the simulation's 95% CI)")
    print()

    # Reading
    wins = [r for r in rows if r["jit"]["wasted_fraction"] < r["periodic"]["wasted_fraction"]]
    loses = [r for r in rows if r not in wins]
    print("Reading:")
    if wins:
        best = max(wins, key=lambda r: r["ratio_periodic_to_jit"])
        print(f"  JIT wastes less at N = {', '.join(str(r['gpus']) for r in wins)}; "
              f"ratio periodic/JIT {min(r['ratio_periodic_to_jit'] for r in wins):.3g}x"
              f"-{best['ratio_periodic_to_jit']:.3g}x.")
        for r in wins:
            if r["gpus"] in (16384, max(x["gpus"] for x in wins)):
                saved = r["periodic"]["wasted_gpu_hours_per_day"] - r["jit"]["wasted_gpu_hours_per_day"]
                print(f"  at N = {r['gpus']}: periodic {100 * r['periodic']['wasted_fraction']:.3g}% vs "
                      f"JIT {100 * r['jit']['wasted_fraction']:.3g}% -> {saved:,.0f} GPU-hours/day saved "
                      f"({saved / 24:,.0f} GPUs' worth).")
    if loses:
        print(f"  periodic wastes less at N = {', '.join(str(r['gpus']) for r in loses)} "
              f"(JIT's steady overhead or flush outweighs the rare failures there).")
    # crossover on a fine grid
    grid = np.unique(np.geomspace(1, 4 * max(a.gpus), 400).astype(int))
    sign = [jit_waste(base.with_gpus(int(n))) < periodic_waste(base.with_gpus(int(n))) for n in grid]
    flips = [int(grid[i]) for i in range(1, len(grid)) if sign[i] != sign[i - 1]]
    if flips:
        print(f"  the policies cross near N = {', '.join(map(str, flips))}.")
    else:
        print(f"  no crossover for N in [1, {4 * max(a.gpus)}]: "
              f"{'JIT' if sign[0] else 'periodic'} wins throughout.")
    worst = rows[-1]
    print(f"  waste grows with N for both: job MTBF falls as 1/N, periodic waste ~ sqrt(2C/M) "
          f"(+(D+R)/M), JIT waste ~ (D+F+R+T_it/2)/M; at N = {worst['gpus']} the job MTBF is "
          f"{60 * worst['job_mtbf_hours']:.0f} min.")

    if not a.no_plot:
        title = (f"per-GPU MTBF {gpu_mtbf_h:,.0f} h, T_it={a.iter_seconds:g}s, C={c:g}s, F={f:g}s, "
                 f"R={a.r_seconds:g}s, D={a.d_seconds:g}s, o={a.jit_overhead:g}")
        plot(a.png, base, a.gpus, mc, title)
        print(f"\nsaved {a.png}")
    print(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
