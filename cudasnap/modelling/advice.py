"""``cudasnap advise``: periodic or just-in-time checkpointing for one job, and why.

:func:`advise` turns a job's size, failure rate, iteration time and state size
into the policies' expected waste (the exact-for-exponential closed form of
:mod:`cudasnap.modelling.analysis`) and a pick with its reasons; :func:`format_advice`
prints it.  Besides periodic and JIT (full restarts) it reports JIT with in-process
restart (:mod:`cudasnap.modelling.restart`): what the pick between periodic and JIT
saves again when the restart keeps the healthy processes. The command line adds the
host-memory fit and a ``snapshot_every`` pick (:mod:`cudasnap.core.host_fit`).
"""
from __future__ import annotations

import math
from typing import Any

from .analysis import (
    DEFAULT_CHECKPOINT_GBPS,
    DEFAULT_DETECT_SECONDS,
    DEFAULT_FLUSH_GBPS,
    DEFAULT_JIT_OVERHEAD,
    DEFAULT_RESTART_SECONDS,
    Scenario,
    _fraction,
    _non_negative,
    _positive,
    _positive_int,
    compare,
)
from .restart import (
    DEFAULT_INPROCESS_PARTS,
    DEFAULT_SPARE_REFILL_SECONDS,
    DEFAULT_SPARES_PER_1K,
    RestartParts,
    parts_for_state,
)

__all__ = ["advise", "format_advice"]


def advise(
    gpus: int,
    mtbf_hours: float,
    iter_seconds: float,
    state_gb: float,
    *,
    checkpoint_gbps: float = DEFAULT_CHECKPOINT_GBPS,
    flush_gbps: float = DEFAULT_FLUSH_GBPS,
    restart_seconds: float = DEFAULT_RESTART_SECONDS,
    detect_seconds: float = DEFAULT_DETECT_SECONDS,
    per_gpu: bool = True,
    jit_overhead: float = DEFAULT_JIT_OVERHEAD,
    checkpoint_seconds: float | None = None,
    flush_seconds: float | None = None,
    inprocess_parts: RestartParts | None = None,
    inprocess_seconds: float | None = None,
    spares_per_1k: float | None = DEFAULT_SPARES_PER_1K,
    spare_refill_hours: float = DEFAULT_SPARE_REFILL_SECONDS / 3600.0,
) -> dict[str, Any]:
    """Expected waste of periodic (Daly interval) and JIT checkpointing, and a pick.

    ``mtbf_hours`` is the per-GPU MTBF when ``per_gpu`` is true (default; the
    job MTBF is then ``mtbf_hours / gpus``), else the MTBF of the whole job of
    ``gpus`` GPUs.  ``state_gb`` is the checkpoint state held by one GPU; the
    periodic stall is ``C = state_gb / checkpoint_gbps`` and the JIT flush is
    ``F = state_gb / flush_gbps`` unless ``checkpoint_seconds`` /
    ``flush_seconds`` give measured values.  Wastes use the exact-for-exponential
    closed form.  Returns a dict (see ``format_advice``) whose
    ``"recommendation"`` is ``"jit"`` or ``"periodic"`` with ``"reasons"``; ``"jit_inprocess"``
    and ``"goodput"`` add JIT with in-process restart: ``inprocess_parts`` as measured (default
    :mod:`.restart`'s, regroup grown with ``gpus``, restore of ``state_gb``) or a measured
    total ``inprocess_seconds``; ``spares_per_1k`` spare units per 1,024 GPUs (None: unlimited),
    each back after ``spare_refill_hours``; with no spare left a failure pays a full restart.
    """
    n = _positive_int("gpus", gpus)
    mtbf_h = _positive("mtbf_hours", mtbf_hours)
    t_it = _positive("iter_seconds", iter_seconds)
    state = _non_negative("state_gb", state_gb)
    ck_bw = _positive("checkpoint_gbps", checkpoint_gbps)
    fl_bw = _positive("flush_gbps", flush_gbps)
    r = _non_negative("restart_seconds", restart_seconds)
    d = _non_negative("detect_seconds", detect_seconds)
    o = _fraction("jit_overhead", jit_overhead)
    c = state / ck_bw if checkpoint_seconds is None else _positive("checkpoint_seconds", checkpoint_seconds)
    if c <= 0.0:
        raise ValueError(f"state_gb must be positive (or pass checkpoint_seconds), got {state_gb!r}")
    f = state / fl_bw if flush_seconds is None else _non_negative("flush_seconds", flush_seconds)
    parts = _parts(inprocess_parts, inprocess_seconds, state)
    refill_s = _non_negative("spare_refill_hours", spare_refill_hours) * 3600.0
    s = Scenario.from_hours(n, mtbf_h if per_gpu else mtbf_h * n, t_it, c, f, restart_s=r, detect_s=d,
                            jit_overhead=o, inprocess=parts, spares_per_1k=spares_per_1k, spare_refill_s=refill_s)
    res = compare(s)
    per, jit = res["periodic"], res["jit"]
    pick = "jit" if jit["wasted_fraction"] < per["wasted_fraction"] else "periodic"
    reasons = _reasons(res, pick, c=c, f=f, d=d, r=r, o=o)
    notes = _notes(checkpoint_seconds is not None and flush_seconds is not None,
                   inprocess_parts is not None or inprocess_seconds is not None)
    return {
        "inputs": {
            "gpus": n,
            "mtbf_hours": mtbf_h,
            "per_gpu": bool(per_gpu),
            "iter_seconds": t_it,
            "state_gb": state,
            "checkpoint_gbps": ck_bw,
            "flush_gbps": fl_bw,
            "restart_seconds": r,
            "detect_seconds": d,
            "jit_overhead": o,
            "inprocess_parts": parts.as_dict(),
            "spares_per_1k": spares_per_1k,
            "spare_refill_hours": refill_s / 3600.0,
        },
        "checkpoint_seconds": c,
        "flush_seconds": f,
        **res,
        "recommendation": pick,
        "reasons": reasons,
        "notes": notes,
    }


def _notes(measured_costs: bool, measured_parts: bool) -> list[str]:
    return [
        "JIT needs a surviving copy of every state shard (e.g. data-parallel replicas); "
        "keep infrequent periodic checkpoints as a fallback for failures that lose all copies",
        "costs C, F, R, D are "
        + ("measured inputs" if measured_costs
           else "derived from state_gb and bandwidth defaults; pass measured figures"),
        "in-process restart: " + ("measured inputs" if measured_parts else
                                  "parts measured for a lost node on 4 CPU ranks, the re-formation "
                                  "grown with the job to 150 s at 102,400 GPUs and the restore "
                                  "at 10 GB/s per GPU (assumptions)")
        + "; it needs a warm spare per lost rank and host memory for the snapshots",
    ]


def _parts(parts: RestartParts | None, seconds: float | None, state_gb: float) -> RestartParts:
    """The in-process parts of ``advise``: given, a measured total, or the default (its
    restore for ``state_gb`` per GPU)."""
    if parts is not None and seconds is not None:
        raise ValueError("give inprocess_parts or inprocess_seconds, not both")
    if seconds is not None:
        return RestartParts(0.0, 0.0, 0.0, 0.0, other_s=_non_negative("inprocess_seconds", seconds))
    return parts_for_state(state_gb, DEFAULT_INPROCESS_PARTS) if parts is None else parts


def _reasons(res: dict[str, Any], pick: str, *, c: float, f: float, d: float, r: float,
             o: float) -> list[str]:
    """Why ``pick`` wins, in words: the waste of each, the job MTBF, what each costs per
    failure (C, F, D, R, the JIT overhead ``o`` as in ``advise``)."""
    per, jit = res["periodic"], res["jit"]
    reasons: list[str] = []
    diff = abs(per["wasted_gpu_hours_per_day"] - jit["wasted_gpu_hours_per_day"])
    lo, hi = sorted((per["wasted_fraction"], jit["wasted_fraction"]))
    other = "periodic" if pick == "jit" else "jit"
    reasons.append(
        f"{pick} wastes {100 * lo:.3g}% of GPU time vs {100 * hi:.3g}% for {other} "
        f"({hi / lo if lo > 0 else math.inf:.3g}x less, {_gpu_hours(diff)} GPU-hours/day saved)"
    )
    reasons.append(
        f"job MTBF {res['job_mtbf_hours']:.4g} h ({res['failures_per_day']:.3g} failures/day)"
    )
    reasons.append(
        f"periodic: checkpoint every {per['interval_seconds'] / 60:.3g} min (Daly) costs "
        f"C/tau = {100 * c / per['interval_seconds']:.3g}% plus, per failure, "
        f"~{per['lost_work_expected_seconds'] / 60:.3g} min lost work + D+R = {d + r:.4g} s"
    )
    reasons.append(
        f"jit: per failure D+F+R = {d + f + r:.4g} s plus <= 1 iteration "
        f"(expected {jit['lost_work_expected_seconds']:.3g} s), steady overhead {100 * o:.3g}%"
    )
    ip = res["jit_inprocess"]
    reasons.append(
        f"jit with in-process restart: per failure {ip['per_failure_seconds']:.4g} s "
        f"(detect + regroup + spare take-over + restore from host memory), "
        f"{_pct(ip['fallback_probability'])} of failures find no spare and pay D+F+R; "
        f"wastes {100 * ip['wasted_fraction']:.3g}% ({_gpu_hours(ip['wasted_gpu_hours_per_day'])} "
        f"GPU-hours/day)"
    )
    if pick == "periodic":
        if o >= c / per["interval_seconds"]:
            reasons.append("the JIT steady-state overhead exceeds the periodic checkpoint overhead")
        if f > per["lost_work_expected_seconds"]:
            reasons.append("the JIT flush takes longer than the work periodic loses per failure")
    return reasons


def _pct(p: float) -> str:
    return "< 0.01%" if 0.0 < p < 1e-4 else f"{100 * p:.3g}%"


def _gpu_hours(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def format_advice(d: dict[str, Any]) -> str:
    """Human-readable report of an :func:`advise` result."""
    inp, per, jit, ip = d["inputs"], d["periodic"], d["jit"], d["jit_inprocess"]
    parts = ip["parts"]
    mtbf_kind = "per-GPU" if inp["per_gpu"] else "job"
    lines = [
        f"cudasnap advise: {inp['gpus']} GPUs, {mtbf_kind} MTBF {inp['mtbf_hours']:.6g} h "
        f"(job MTBF {d['job_mtbf_hours']:.4g} h, {d['failures_per_day']:.3g} failures/day)",
        f"  iteration {inp['iter_seconds']:.4g} s, state {inp['state_gb']:.4g} GB/GPU, "
        f"C = {d['checkpoint_seconds']:.4g} s, F = {d['flush_seconds']:.4g} s, "
        f"R = {inp['restart_seconds']:.4g} s, D = {inp['detect_seconds']:.4g} s",
        f"  in-process restart {ip['per_failure_seconds']:.4g} s = detect {parts['detect_s']:.3g} "
        f"+ regroup {parts['regroup_s']:.3g} + take-over {parts['takeover_s']:.3g} + restore "
        f"{parts['restore_s']:.3g}" + (f" + other {parts['other_s']:.3g}" if parts["other_s"] else "")
        + f" s; no spare left for {_pct(ip['fallback_probability'])} of failures",
        "",
        f"  {'policy':<9} {'interval':>12} {'wasted %':>10} {'GPU-h/day':>12}",
        f"  {'periodic':<9} {per['interval_seconds'] / 60:>10.4g} m "
        f"{100 * per['wasted_fraction']:>10.4g} {_gpu_hours(per['wasted_gpu_hours_per_day']):>12}",
        f"  {'jit':<9} {jit['interval_seconds']:>10.4g} s "
        f"{100 * jit['wasted_fraction']:>10.4g} {_gpu_hours(jit['wasted_gpu_hours_per_day']):>12}",
        f"  {'jit+inproc':<9} {jit['interval_seconds']:>10.4g} s "
        f"{100 * ip['wasted_fraction']:>10.4g} {_gpu_hours(ip['wasted_gpu_hours_per_day']):>12}",
        f"  (Young interval {per['young_interval_seconds'] / 60:.4g} min; "
        f"periodic/jit waste ratio {d['ratio_periodic_to_jit']:.3g}; goodput "
        + ", ".join(f"{k} {100 * v:.4g}%" for k, v in d["goodput"].items()) + ")",
        "",
        f"Recommendation: {d['recommendation']}",
    ]
    lines += [f"  - {r}" for r in d["reasons"]]
    if d.get("snapshot_every"):
        lines.append(f"  - {d['snapshot_every']['message']}")
    if d.get("host_memory"):
        lines.append(f"  - host memory: {d['host_memory']['message']}")
    lines += [f"  note: {n}" for n in d.get("notes", [])]
    return "\n".join(lines)
