"""Wasted-work model: periodic (Young/Daly) checkpointing versus JIT checkpointing.

This module answers "how many GPU-hours a day does a job of N GPUs lose to
failures, under periodic checkpointing and under just-in-time (JIT)
checkpointing?", with a closed form and a seeded Monte-Carlo simulation that
checks it.  It imports only the standard library and numpy.

Symbols (all times in seconds inside the module)
-------------------------------------------------
``N``      GPUs in the job.
``m``      per-GPU mean time between failures (MTBF); ``lambda = 1/m``.
``M``      job MTBF, ``M = m / N`` (any GPU failing interrupts the synchronous job).
``C``      periodic checkpoint cost: time the job is stalled per checkpoint.
``tau``    compute time between two periodic checkpoints.
``R``      restart cost (reschedule, re-initialise, reload state).
``D``      failure detection time (watchdog / collective timeout).  It is paid by
           *both* policies: a job has to notice a failure before it can restart.
           Set it to 0 to get the textbook periodic model, which has only ``R``.
``F``      JIT flush time: after a failure the surviving replicas write the last
           completed iteration's state.
``T_it``   iteration time; ``o`` the steady-state JIT bookkeeping overhead, as a
           fraction of ``T_it`` (each iteration takes ``T_it * (1 + o)``).

One model for both policies ("segment model")
---------------------------------------------
A job runs segments of ``w`` seconds of useful work followed by ``c`` seconds of
overhead; a segment's work is kept only once the whole segment is over.  A
failure anywhere in a segment loses that segment's work and is followed by a
downtime ``d``; a failure during the downtime starts the downtime over.
Failures form a Poisson process of rate ``1/M`` in wall-clock time.

* periodic: ``w = tau``, ``c = C``, ``d = D + R``;
* JIT: ``w = T_it``, ``c = o * T_it``, ``d = D + F + R`` (JIT resumes from the
  last completed iteration, so it loses at most one iteration: expected
  ``E[lost] = M - T/(exp(T/M) - 1) ~= T/2`` with ``T = T_it*(1+o)``, worst case
  ``T``);
* JIT with in-process restart (``jit_inprocess``): JIT's ``w`` and ``c``; per failure
  the sum of the measured restart parts (detection, re-formation, spare take-over,
  restore from host memory: no ``F``, no ``R``), or ``D + F + R`` when no spare is
  left; see :mod:`cudasnap.modelling.restart`.  Goodput is ``1 - waste``.

Closed forms, both returned by :func:`segment_waste`:

* **exact for exponential** (Daly 2006, eq. for the expected wall time of a
  segment when failures may also strike checkpoints and restarts)::

      E[segment] = M * exp(d/M) * (exp((w + c)/M) - 1)
      waste      = 1 - w / E[segment]             (fraction of wall-clock time)

  Derivation: an attempt lasts ``E[min(X, w+c)] = M (1 - e^{-(w+c)/M})``; it
  fails with probability ``1 - e^{-(w+c)/M}``; a downtime that restarts on
  failure lasts ``M (e^{d/M} - 1)`` on average; solve the renewal equation.

* **first order** (Young 1974; valid when ``w+c``, ``d`` << ``M``)::

      waste ~= c/w + (d + (w + c)/2) / M

  ``(w+c)/2`` is the expected lost work when a failure is uniform in a segment
  (the first-order limit of the exact ``M - L/(e^{L/M} - 1)``).  Minimising it
  over ``tau`` gives Young's interval ``tau = sqrt(2 C M)``.  The first-order
  value is clipped to 1.

The periodic policy uses Daly's (2006) higher-order interval by default::

    tau = sqrt(2CM) * [1 + (1/3) sqrt(C/(2M)) + (1/9) (C/(2M))] - C   if C < 2M
    tau = M                                                            otherwise

Wasted GPU-hours per day = ``waste * N * 24``.

Monte-Carlo simulation: :mod:`cudasnap.modelling.simulate` checks these closed forms
(and shows what a Weibull failure process changes). Advice for one job (the
``cudasnap advise`` report): :mod:`cudasnap.modelling.advice`.

Failure-rate presets (public numbers)
-------------------------------------
:mod:`cudasnap.modelling.presets`: Llama 3 405B pre-training (Meta,
2024) and Meta's research clusters (Kokolis et al., 2024/2025), with their arithmetic.

Default costs (named constants; replace them with measured figures)
-------------------------------------------------------------------
``DEFAULT_CHECKPOINT_GBPS`` (per-GPU bandwidth that sets the blocking time of a
periodic checkpoint, ``C = state_gb / checkpoint_gbps``), ``DEFAULT_FLUSH_GBPS``
(``F = state_gb / flush_gbps``), ``DEFAULT_RESTART_SECONDS``,
``DEFAULT_DETECT_SECONDS`` and ``DEFAULT_JIT_OVERHEAD`` are assumptions, not
measurements.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from .restart import (
    DEFAULT_INPROCESS_PARTS,
    DEFAULT_SPARE_REFILL_SECONDS,
    DEFAULT_SPARES_PER_1K,
    RestartParts,
    fallback_probability,
    mixed_downtime,
)

__all__ = [
    "DEFAULT_CHECKPOINT_GBPS",
    "DEFAULT_FLUSH_GBPS",
    "DEFAULT_RESTART_SECONDS",
    "DEFAULT_DETECT_SECONDS",
    "DEFAULT_JIT_OVERHEAD",
    "DEFAULT_SIM_FAILURES",
    "DEFAULT_SIM_REPLICATIONS",
    "Scenario",
    "young_interval",
    "daly_interval",
    "expected_lost_work",
    "segment_waste",
    "periodic_waste",
    "jit_waste",
    "inprocess_waste",
    "compare",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# Default costs (assumptions; the lead replaces them with measured figures).
# --------------------------------------------------------------------------
DEFAULT_CHECKPOINT_GBPS: float = 2.0
"""Per-GPU GB/s that sets the blocking time of a periodic (async) checkpoint."""
DEFAULT_FLUSH_GBPS: float = 1.0
"""Per-GPU GB/s of the JIT flush after a failure."""
DEFAULT_RESTART_SECONDS: float = 300.0
"""Restart cost R: reschedule, re-initialise communicators, reload state."""
DEFAULT_DETECT_SECONDS: float = 60.0
"""Detection time D: watchdog / collective timeout before recovery starts."""
DEFAULT_JIT_OVERHEAD: float = 0.0
"""Steady-state JIT overhead as a fraction of the iteration time."""

DEFAULT_SIM_FAILURES: float = 2000.0
"""Default simulation horizon, in job MTBFs (so about this many failures)."""
DEFAULT_SIM_REPLICATIONS: int = 20

SECONDS_PER_HOUR: float = 3600.0
HOURS_PER_DAY: float = 24.0

Policy = Literal["periodic", "jit", "jit_inprocess"]


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------
def _positive(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def _non_negative(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return v


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _fraction(name: str, value: float) -> float:
    v = _non_negative(name, value)
    if v >= 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return v


# --------------------------------------------------------------------------
# Scenario
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One job and its costs, all times in seconds.

    ``gpu_mtbf_s`` is the per-GPU MTBF ``m``; the job MTBF is ``m / gpus``.  ``inprocess``,
    ``spares_per_1k`` (None: unlimited spares) and ``spare_refill_s`` set the in-process
    restart (:mod:`cudasnap.modelling.restart`).
    """

    gpus: int
    gpu_mtbf_s: float
    iter_s: float
    checkpoint_s: float
    flush_s: float
    restart_s: float = DEFAULT_RESTART_SECONDS
    detect_s: float = DEFAULT_DETECT_SECONDS
    jit_overhead: float = DEFAULT_JIT_OVERHEAD
    inprocess: RestartParts = DEFAULT_INPROCESS_PARTS
    spares_per_1k: float | None = DEFAULT_SPARES_PER_1K
    spare_refill_s: float = DEFAULT_SPARE_REFILL_SECONDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", _positive_int("gpus", self.gpus))
        object.__setattr__(self, "gpu_mtbf_s", _positive("gpu_mtbf_s", self.gpu_mtbf_s))
        object.__setattr__(self, "iter_s", _positive("iter_s", self.iter_s))
        object.__setattr__(self, "checkpoint_s", _positive("checkpoint_s", self.checkpoint_s))
        object.__setattr__(self, "flush_s", _non_negative("flush_s", self.flush_s))
        object.__setattr__(self, "restart_s", _non_negative("restart_s", self.restart_s))
        object.__setattr__(self, "detect_s", _non_negative("detect_s", self.detect_s))
        object.__setattr__(self, "jit_overhead", _fraction("jit_overhead", self.jit_overhead))
        if not isinstance(self.inprocess, RestartParts):
            raise ValueError(f"inprocess must be RestartParts, got {self.inprocess!r}")
        if self.spares_per_1k is not None:
            object.__setattr__(self, "spares_per_1k", _non_negative("spares_per_1k", self.spares_per_1k))
        object.__setattr__(self, "spare_refill_s", _non_negative("spare_refill_s", self.spare_refill_s))

    @classmethod
    def from_hours(
        cls,
        gpus: int,
        gpu_mtbf_hours: float,
        iter_s: float,
        checkpoint_s: float,
        flush_s: float,
        restart_s: float = DEFAULT_RESTART_SECONDS,
        detect_s: float = DEFAULT_DETECT_SECONDS,
        jit_overhead: float = DEFAULT_JIT_OVERHEAD,
        **inprocess: Any,
    ) -> "Scenario":
        """Per-GPU MTBF in hours; ``inprocess``: the in-process fields by name."""
        return cls(
            gpus=gpus,
            gpu_mtbf_s=_positive("gpu_mtbf_hours", gpu_mtbf_hours) * SECONDS_PER_HOUR,
            iter_s=iter_s,
            checkpoint_s=checkpoint_s,
            flush_s=flush_s,
            restart_s=restart_s,
            detect_s=detect_s,
            jit_overhead=jit_overhead,
            **inprocess,
        )

    @property
    def job_mtbf_s(self) -> float:
        return self.gpu_mtbf_s / self.gpus

    def with_gpus(self, gpus: int) -> "Scenario":
        return replace(self, gpus=gpus)

    def inprocess_downtimes(self) -> list[tuple[float, float]]:
        """``[(probability, seconds), ...]`` of an in-process restart's downtime: the parts
        at this size, or (no spare left) the full restart ``D + F + R``."""
        p = fallback_probability(self.gpus, self.job_mtbf_s, self.spares_per_1k, self.spare_refill_s)
        full = self.detect_s + self.flush_s + self.restart_s
        return [(1.0 - p, self.inprocess.at(self.gpus).total), (p, full)]

    def segments(self, policy: Policy, interval_s: float | None = None) -> tuple[float, float, float]:
        """``(work, overhead, downtime)`` of one segment of ``policy`` (for
        ``jit_inprocess`` the constant downtime equivalent to its mix, see ``restart``)."""
        if policy == "periodic":
            tau = daly_interval(self.checkpoint_s, self.job_mtbf_s) if interval_s is None else (
                _positive("interval_s", interval_s)
            )
            return tau, self.checkpoint_s, self.detect_s + self.restart_s
        if policy == "jit":
            return (
                self.iter_s,
                self.jit_overhead * self.iter_s,
                self.detect_s + self.flush_s + self.restart_s,
            )
        if policy == "jit_inprocess":
            d = mixed_downtime(self.inprocess_downtimes(), self.job_mtbf_s)
            return self.iter_s, self.jit_overhead * self.iter_s, d
        raise ValueError(f"policy must be 'periodic', 'jit' or 'jit_inprocess', got {policy!r}")


# --------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------
def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): ``tau = sqrt(2 C M)``, ``M`` the job MTBF."""
    c = _positive("checkpoint_s", checkpoint_s)
    m = _positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * c * m)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum compute interval between checkpoints.

    ``sqrt(2CM) [1 + (1/3) sqrt(C/2M) + (1/9) C/2M] - C`` for ``C < 2M``, else ``M``.
    """
    c = _positive("checkpoint_s", checkpoint_s)
    m = _positive("mtbf_s", mtbf_s)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def expected_lost_work(segment_s: float, mtbf_s: float) -> float:
    """Exact expected work lost to a failure that strikes a segment of length ``L``.

    ``E[X | X < L] = M - L / (exp(L/M) - 1)`` for exponential ``X`` (``~= L/2``).
    """
    seg = _positive("segment_s", segment_s)
    m = _positive("mtbf_s", mtbf_s)
    r = seg / m
    if r < 1e-6:  # series, avoids cancellation: L/2 - L^2/(12 M)
        return seg / 2.0 - seg * r / 12.0
    return m - seg / math.expm1(r)


def segment_waste(
    work_s: float, overhead_s: float, downtime_s: float, mtbf_s: float, *, exact: bool = True
) -> float:
    """Wasted fraction of wall-clock time of the segment model (see module doc).

    ``exact=True``: ``1 - w / (M e^{d/M} (e^{(w+c)/M} - 1))`` (exact for exponential);
    ``exact=False``: ``min(1, c/w + (d + (w+c)/2)/M)`` (first order).
    """
    w = _positive("work_s", work_s)
    c = _non_negative("overhead_s", overhead_s)
    d = _non_negative("downtime_s", downtime_s)
    m = _positive("mtbf_s", mtbf_s)
    if not exact:
        return min(1.0, c / w + (d + (w + c) / 2.0) / m)
    log_e = math.log(m) + d / m + math.log(math.expm1((w + c) / m))  # log E[segment]
    # waste = 1 - w/E  computed as -expm1(log w - log E), accurate for small waste
    return float(-math.expm1(math.log(w) - log_e))


def periodic_waste(s: Scenario, interval_s: float | None = None, *, exact: bool = True) -> float:
    """Wasted fraction under periodic checkpointing every ``interval_s`` (default: Daly)."""
    w, c, d = s.segments("periodic", interval_s)
    return segment_waste(w, c, d, s.job_mtbf_s, exact=exact)


def jit_waste(s: Scenario, *, exact: bool = True) -> float:
    """Wasted fraction under JIT checkpointing (``D+F+R`` + lost partial iteration)."""
    w, c, d = s.segments("jit")
    return segment_waste(w, c, d, s.job_mtbf_s, exact=exact)


def inprocess_waste(s: Scenario, *, exact: bool = True) -> float:
    """Wasted fraction under JIT with in-process restart (parts, or a full restart with
    no spare left)."""
    w, c, d = s.segments("jit_inprocess")
    return segment_waste(w, c, d, s.job_mtbf_s, exact=exact)


def compare(s: Scenario, interval_s: float | None = None) -> dict[str, Any]:
    """The three policies' expected waste (and ``goodput = 1 - waste``) for one scenario."""
    m = s.job_mtbf_s
    tau = daly_interval(s.checkpoint_s, m) if interval_s is None else _positive("interval_s", interval_s)
    per = periodic_waste(s, tau)
    jit = jit_waste(s)
    gpu_hours_day = s.gpus * HOURS_PER_DAY
    jit_seg = s.iter_s * (1.0 + s.jit_overhead)
    return {
        "gpus": s.gpus,
        "job_mtbf_hours": m / SECONDS_PER_HOUR,
        "gpu_mtbf_hours": s.gpu_mtbf_s / SECONDS_PER_HOUR,
        "failures_per_day": HOURS_PER_DAY * SECONDS_PER_HOUR / m,
        "periodic": {
            "interval_seconds": tau,
            "young_interval_seconds": young_interval(s.checkpoint_s, m),
            "daly_interval_seconds": daly_interval(s.checkpoint_s, m),
            "checkpoint_seconds": s.checkpoint_s,
            "per_failure_seconds": s.detect_s + s.restart_s,
            "lost_work_expected_seconds": expected_lost_work(tau + s.checkpoint_s, m),
            "lost_work_worst_seconds": tau + s.checkpoint_s,
            "wasted_fraction": per,
            "wasted_fraction_first_order": periodic_waste(s, tau, exact=False),
            "wasted_gpu_hours_per_day": per * gpu_hours_day,
        },
        "jit": {
            "interval_seconds": s.iter_s,
            "overhead_fraction": s.jit_overhead,
            "per_failure_seconds": s.detect_s + s.flush_s + s.restart_s,
            "lost_work_expected_seconds": expected_lost_work(jit_seg, m),
            "lost_work_worst_seconds": jit_seg,
            "wasted_fraction": jit,
            "wasted_fraction_first_order": jit_waste(s, exact=False),
            "wasted_gpu_hours_per_day": jit * gpu_hours_day,
        },
        "ratio_periodic_to_jit": per / jit if jit > 0 else math.inf,
        "jit_inprocess": _inprocess_row(s, jit_seg, gpu_hours_day),
        "goodput": {"periodic": 1.0 - per, "jit": 1.0 - jit, "jit_inprocess": 1.0 - inprocess_waste(s)},
    }


def _inprocess_row(s: Scenario, jit_seg: float, gpu_hours_day: float) -> dict[str, Any]:
    (_, d_ip), (p_fb, d_full) = s.inprocess_downtimes()
    waste = inprocess_waste(s)
    return {
        "parts": s.inprocess.at(s.gpus).as_dict(),
        "fallback_probability": p_fb,
        "per_failure_seconds": d_ip,
        "fallback_per_failure_seconds": d_full,
        "effective_per_failure_seconds": s.segments("jit_inprocess")[2],
        "lost_work_expected_seconds": expected_lost_work(jit_seg, s.job_mtbf_s),
        "wasted_fraction": waste,
        "wasted_fraction_first_order": inprocess_waste(s, exact=False),
        "wasted_gpu_hours_per_day": waste * gpu_hours_day,
    }
