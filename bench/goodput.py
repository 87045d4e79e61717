"""Goodput at 1k, 10k and 100k GPUs: periodic, JIT with full restarts, JIT with in-process restart.

For each failure-rate preset (``cudasnap.modelling.presets``: Llama 3 405B, Meta 2024; Meta's
research clusters, Kokolis et al. 2024/2025) and each job size, prints one JSON line with the
goodput (``1 - wasted fraction``, exact-for-exponential closed form of
``cudasnap.modelling.analysis``) of the three policies, a seeded Monte-Carlo check of each
(``cudasnap.modelling.simulate``, 95% CI), and two variants of the in-process policy that show
what its assumptions are worth; then a Markdown table on stderr, and saves ``bench/goodput.png``
(goodput against N from 8 to 131,072 GPUs, one panel per preset).

Costs (as ``bench/wasted_work.py``): 8 s iterations, 60 GB of state per GPU (C = 30 s at
2 GB/s, F = 60 s at 1 GB/s), R = 300 s, D = 60 s (assumptions of ``analysis``). In-process
restart: the parts measured on this machine for a lost node (detect 1.45 + regroup 0.05 +
spare take-over 0.22 + restore 0.055 s, ``cudasnap.modelling.restart``), the re-formation grown
linearly to ``--regroup-at-100k`` (150 s at 102,400 GPUs: an assumption from NVIDIA/nccl #1156
and #1789), the restore of the state at ``--restore-gbps`` (10 GB/s per GPU: 6 s for 60 GB, an
assumption), ``--spares-per-1k`` spare units per 1,024 GPUs, each back after
``--spare-refill-hours``; a failure with no spare left pays the full restart D + F + R.

Variants in the JSON: ``jit_inprocess_regroup_here`` keeps the re-formation measured here
(0.05 s, 4 gloo ranks: an optimistic bound); ``jit_inprocess_detect_as_full`` detects with the
full restart's D (60 s) instead of the heartbeat's 1.45 s.

    python bench/goodput.py [--quick] [--presets llama3,kokolis] [--gpus 1024,10240,102400]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cudasnap.modelling.analysis import (  # noqa: E402
    DEFAULT_CHECKPOINT_GBPS,
    DEFAULT_DETECT_SECONDS,
    DEFAULT_FLUSH_GBPS,
    DEFAULT_RESTART_SECONDS,
    Scenario,
    compare,
    inprocess_waste,
    jit_waste,
    periodic_waste,
)
from cudasnap.modelling.presets import PRESETS  # noqa: E402
from cudasnap.modelling.restart import (  # noqa: E402
    DEFAULT_RESTORE_GBPS,
    DEFAULT_SPARE_REFILL_SECONDS,
    DEFAULT_SPARES_PER_1K,
    INPROCESS_NODE_LOSS,
    REGROUP_SECONDS_AT_100K,
    parse_parts,
    parts_for_state,
)
from cudasnap.modelling.simulate import simulate_waste  # noqa: E402

DEFAULT_GPUS = (1024, 10240, 102400)
DEFAULT_PNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goodput.png")
POLICIES = ("periodic", "jit", "jit_inprocess")
LABELS = {"periodic": "periodic (Daly interval)", "jit": "JIT, full restart",
          "jit_inprocess": "JIT, in-process restart"}
COLORS = {"periodic": "tab:red", "jit": "tab:blue", "jit_inprocess": "tab:green"}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer Monte-Carlo replications (6)")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    p.add_argument("--gpus", type=_int_list, default=list(DEFAULT_GPUS))
    p.add_argument("--iter-seconds", type=float, default=8.0)
    p.add_argument("--state-gb", type=float, default=60.0)
    p.add_argument("--r-seconds", type=float, default=DEFAULT_RESTART_SECONDS)
    p.add_argument("--d-seconds", type=float, default=DEFAULT_DETECT_SECONDS)
    p.add_argument("--inprocess-parts", default=None, metavar="D,G,T,R",
                   help="in-process parts (seconds) at the measured size (default: a lost node here)")
    p.add_argument("--regroup-at-100k", type=float, default=REGROUP_SECONDS_AT_100K,
                   help="re-formation seconds at 102,400 GPUs (grown linearly; 0: no growth)")
    p.add_argument("--restore-gbps", type=float, default=DEFAULT_RESTORE_GBPS,
                   help="per-GPU GB/s of the restore from host memory (restore = state / this)")
    p.add_argument("--spares-per-1k", type=float, default=DEFAULT_SPARES_PER_1K)
    p.add_argument("--spare-refill-hours", type=float, default=DEFAULT_SPARE_REFILL_SECONDS / 3600)
    p.add_argument("--replications", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mc", action="store_true", help="skip the Monte-Carlo check")
    p.add_argument("--png", default=DEFAULT_PNG)
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    unknown = [x for x in a.presets.split(",") if x not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; known: {sorted(PRESETS)}")
    return a


def base_scenario(a: argparse.Namespace, gpu_mtbf_h: float) -> Scenario:
    parts = parse_parts(a.inprocess_parts) if a.inprocess_parts else INPROCESS_NODE_LOSS
    parts = parts_for_state(a.state_gb, replace(parts, regroup_s_per_gpu=a.regroup_at_100k / 102_400),
                            a.restore_gbps)
    return Scenario.from_hours(
        8, gpu_mtbf_h, a.iter_seconds, a.state_gb / DEFAULT_CHECKPOINT_GBPS,
        a.state_gb / DEFAULT_FLUSH_GBPS, restart_s=a.r_seconds, detect_s=a.d_seconds,
        inprocess=parts, spares_per_1k=a.spares_per_1k, spare_refill_s=a.spare_refill_hours * 3600,
    )


def variants(s: Scenario) -> dict[str, Scenario]:
    """The in-process variants of the module doc, for the JSON and the plot."""
    return {
        "jit_inprocess_regroup_here": replace(s, inprocess=replace(s.inprocess, regroup_s_per_gpu=0.0)),
        "jit_inprocess_detect_as_full": replace(s, inprocess=replace(s.inprocess, detect_s=s.detect_s)),
    }


def row(preset: str, s: Scenario, a: argparse.Namespace, reps: int) -> dict[str, Any]:
    r = compare(s)
    ip = r["jit_inprocess"]
    out: dict[str, Any] = {
        "bench": "goodput", "preset": preset, "gpus": s.gpus,
        "job_mtbf_hours": round(r["job_mtbf_hours"], 4),
        "failures_per_day": round(r["failures_per_day"], 3),
        "goodput": {p: round(g, 5) for p, g in r["goodput"].items()},
        "per_failure_seconds": {"periodic": r["periodic"]["per_failure_seconds"],
                                "jit": r["jit"]["per_failure_seconds"],
                                "jit_inprocess": round(ip["per_failure_seconds"], 3)},
        "inprocess_parts": {k: round(v, 4) for k, v in ip["parts"].items() if k != "regroup_s_per_gpu"},
        "spares": {"per_1k": s.spares_per_1k, "refill_hours": s.spare_refill_s / 3600,
                   "fallback_probability": float(f"{ip['fallback_probability']:.3g}")},
        "periodic_interval_min": round(r["periodic"]["interval_seconds"] / 60, 2),
    }
    for name, v in variants(s).items():
        out[name] = round(1.0 - inprocess_waste(v), 5)
    if reps:
        sim = simulate_waste(s, replications=reps, seed=a.seed)
        out["mc"] = {p: {"goodput": round(1 - sim[p].mean, 5), "ci95": round(sim[p].half_width, 5),
                         "ok": sim[p].contains(r[p]["wasted_fraction"])} for p in POLICIES}
    return out


def _pct(x: float) -> str:
    return "< 0.001%" if 0.0 < x < 1e-5 else f"{100 * x:.3f}%"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| preset | GPUs | job MTBF h | fail/day | periodic | JIT full restart | JIT in-process "
             "| in-proc s/failure | no spare | in-proc, regroup as here | in-proc, D = full's | MC ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["goodput"]
        ok = "/".join("ok" if r["mc"][p]["ok"] else "!!" for p in POLICIES) if "mc" in r else "-"
        lines.append(
            f"| {r['preset']} | {r['gpus']:,} | {r['job_mtbf_hours']:.3g} | {r['failures_per_day']:.3g} "
            f"| {_pct(g['periodic'])} | {_pct(g['jit'])} | {_pct(g['jit_inprocess'])} "
            f"| {r['per_failure_seconds']['jit_inprocess']:.3g} | {_pct(r['spares']['fallback_probability'])} "
            f"| {_pct(r['jit_inprocess_regroup_here'])} | {_pct(r['jit_inprocess_detect_as_full'])} | {ok} |")
    return "\n".join(lines)


def plot(path: str, bases: dict[str, Scenario], gpus: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [int(n) for n in np.unique(np.geomspace(8, 131_072, 160).astype(int))]
    fns = {"periodic": periodic_waste, "jit": jit_waste, "jit_inprocess": inprocess_waste}
    fig, axes = plt.subplots(1, len(bases), figsize=(6.2 * len(bases), 4.6), dpi=120, squeeze=False)
    for ax, (name, base) in zip(axes[0], bases.items()):
        for p in POLICIES:
            ax.plot(grid, [1 - fns[p](base.with_gpus(n)) for n in grid], color=COLORS[p], label=LABELS[p])
            ax.scatter(gpus, [1 - fns[p](base.with_gpus(n)) for n in gpus], color=COLORS[p], s=14, zorder=3)
        here = variants(base)["jit_inprocess_regroup_here"]
        ax.plot(grid, [1 - inprocess_waste(here.with_gpus(n)) for n in grid], color="tab:green",
                ls="--", lw=1, label="JIT, in-process, re-formation as measured here")
        preset = PRESETS[name]
        ax.set_title(f"{name}: per-GPU MTBF {preset.gpu_mtbf_hours:,.0f} h", fontsize=9)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("GPUs in the job (N)")
        ax.set_ylabel("goodput (1 - wasted fraction)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    a = parse_args(argv)
    reps = 0 if a.no_mc else (6 if a.quick else a.replications)
    bases = {name: base_scenario(a, PRESETS[name].gpu_mtbf_hours) for name in a.presets.split(",")}
    rows = []
    for name, base in bases.items():
        for n in a.gpus:
            r = row(name, base.with_gpus(n), a, reps)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(table(rows), file=sys.stderr)
    b = next(iter(bases.values()))
    title = (f"T_it={a.iter_seconds:g}s, C={b.checkpoint_s:g}s, F={b.flush_s:g}s, R={a.r_seconds:g}s, "
             f"D={a.d_seconds:g}s; in-process {b.inprocess.at(1).total:.3g}s (restore "
             f"{b.inprocess.restore_s:.3g}s) + re-formation to "
             f"{a.regroup_at_100k:g}s at 102,400 GPUs; {a.spares_per_1k:g} spares/1,024 GPUs, "
             f"refill {a.spare_refill_hours:g} h")
    if not a.no_plot:
        plot(a.png, bases, a.gpus, title)
        print(f"saved {a.png}", file=sys.stderr)
    print(f"done in {time.time() - t0:.1f} s ({reps} MC replications)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
