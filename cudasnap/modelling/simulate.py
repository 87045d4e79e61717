"""Monte-Carlo check of the wasted-work model of :mod:`cudasnap.modelling.analysis`.

:func:`simulate_waste` draws failure times over a wall-clock horizon and runs
the segment model of the three policies (periodic, JIT with full restarts, JIT with
in-process restart) on the *same* failure trace (common random numbers); the mean
over independent seeded replications comes with a 95% Student-t confidence
interval, so the closed forms can be checked against it.  For the in-process
policy each failure draws its downtime independently: the restart parts, or the
full restart when no spare is left (``Scenario.inprocess_downtimes``), from a
generator of its own, so the other policies' draws do not depend on it.

Failure processes
-----------------
* ``distribution="exponential"``: the job-level Poisson process of rate ``N/m``
  (the superposition of N per-GPU Poisson processes is exactly that).
* ``distribution="weibull"``, ``process="gpu"`` (default): N per-GPU renewal
  processes, Weibull inter-arrival times of shape ``k`` and mean ``m``,
  superposed.  A failed GPU is replaced by a fresh one (a renewal for that GPU
  only); the other N-1 GPUs keep their age.  This is the physical model: a job
  restart does not rejuvenate the hardware.  ``start="stationary"`` (default)
  draws each GPU's first failure from the equilibrium (forward-recurrence)
  distribution, i.e. a fleet that has been running for a long time;
  ``start="fresh"`` starts all GPUs new at time 0 (burn-in of a new cluster).
* ``distribution="weibull"``, ``process="job"``: one renewal process at job level
  with Weibull gaps of mean ``M`` (the clock restarts at every failure), the
  usual assumption in the checkpointing literature; kept for comparison.

What the shape does (the statements the tests rely on):

* ``k = 1`` gives the exponential model in every variant.
* ``start="stationary"``: the superposed process has mean rate exactly ``N/m``
  for any ``k``, and by the Palm-Khintchine theorem it tends to a Poisson
  process as N grows, so at scale the exponential closed form applies.
* ``start="fresh"`` with ``k < 1``: the renewal density of a decreasing-hazard
  distribution is non-increasing and tends to ``1/m``, hence it is ``>= 1/m``
  everywhere and the expected number of failures in any horizon is at least the
  exponential one, ``N*H/m`` (infant mortality).  Both policies then waste more
  than the exponential closed form predicts; the gap shrinks as ``H/m`` grows.
* ``process="job"`` with ``k < 1``: failures cluster right after restarts, so
  more of them land in a downtime or early in a segment.  In the simulations
  we ran (N = 1,024 to 131,072, k = 0.7) both policies then wasted *less* than
  the exponential closed form; this is an observation, not a theorem, and the
  tests do not assert it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .analysis import (
    DEFAULT_SIM_FAILURES,
    DEFAULT_SIM_REPLICATIONS,
    Scenario,
    _positive,
    _positive_int,
    logger,
)


@dataclass(frozen=True)
class SimResult:
    """Mean wasted fraction over replications, with a 95% Student-t CI."""

    mean: float
    ci_low: float
    ci_high: float
    std: float
    replications: int
    failures_per_replication: float

    @property
    def half_width(self) -> float:
        return (self.ci_high - self.ci_low) / 2.0

    def contains(self, value: float) -> bool:
        return self.ci_low <= value <= self.ci_high


def _t975(df: int) -> float:
    """0.975 quantile of Student's t (Cornish-Fisher expansion; < 1e-3 off for df >= 5)."""
    exact = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}
    if df in exact:
        return exact[df]
    z = 1.959963984540054
    return (
        z
        + (z**3 + z) / (4.0 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96.0 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384.0 * df**3)
    )


def _renewal_times(
    first: np.ndarray,
    draw: Callable[[tuple[int, int]], np.ndarray],
    mean: float,
    horizon: float,
) -> np.ndarray:
    """All renewal epochs < ``horizon`` of independent processes whose first epochs are ``first``.

    Gaps are drawn in blocks (one row per still-active process) to stay vectorised.
    """
    chunks: list[np.ndarray] = []
    active = first[first < horizon]
    if active.size:
        chunks.append(active)
    while active.size:
        block = int(max(1, min(math.ceil(1.2 * horizon / mean) + 4, 2_000_000 // active.size)))
        path = active[:, None] + np.cumsum(draw((active.size, block)), axis=1)
        chunks.append(path[path < horizon])
        last = path[:, -1]
        active = last[last < horizon]
    if not chunks:
        return np.empty(0)
    return np.sort(np.concatenate(chunks))


def _failure_times(
    rng: np.random.Generator,
    gpus: int,
    gpu_mtbf_s: float,
    horizon: float,
    distribution: str,
    shape: float,
    process: str,
    start: str,
) -> np.ndarray:
    """Sorted failure epochs of the whole job in ``[0, horizon)``."""
    if distribution == "exponential":
        job_m = gpu_mtbf_s / gpus
        first = rng.exponential(job_m, size=1)
        return _renewal_times(first, lambda sz: rng.exponential(job_m, size=sz), job_m, horizon)
    # Weibull of mean ``mean``: scale = mean / Gamma(1 + 1/k)
    n, mean = (gpus, gpu_mtbf_s) if process == "gpu" else (1, gpu_mtbf_s / gpus)
    scale = mean / math.gamma(1.0 + 1.0 / shape)
    if start == "stationary":
        # forward-recurrence time = U * (length-biased gap); a length-biased
        # Weibull gap is scale * G^(1/k) with G ~ Gamma(1 + 1/k).
        biased = scale * rng.gamma(1.0 + 1.0 / shape, size=n) ** (1.0 / shape)
        first = rng.random(n) * biased
    else:
        first = scale * rng.weibull(shape, size=n)
    return _renewal_times(first, lambda sz: scale * rng.weibull(shape, size=sz), mean, horizon)


def _useful_work(
    failures: np.ndarray, horizon: float, work: float, overhead: float,
    downtime: float | np.ndarray,
) -> float:
    """Useful work done in ``[0, horizon)`` by the segment model on a failure trace.

    The job computes from 0; after failure ``f_j`` it is down until ``f_j + d``
    unless another failure comes first (then the downtime starts over), so the
    compute windows are ``[0, f_1)``, ``[f_j + d, f_{j+1})`` when positive, and
    ``[f_last + d, horizon)`` (``downtime`` a number, or one per failure: ``d_j``
    is failure ``j``'s).  A window of length ``g`` commits
    ``floor(g / (w + c))`` segments; in the final window the unfinished
    segment's compute is counted as useful (an O(segment/horizon) edge effect).
    """
    seg = work + overhead
    if failures.size == 0:
        gaps = np.empty(0)
        final = horizon
    else:
        ends = failures + downtime  # when the downtime that failure j starts is over
        starts = np.concatenate(([0.0], ends[:-1]))
        gaps = failures - starts
        final = horizon - float(ends[-1])
    gaps = gaps[gaps > 0.0]
    useful = float(np.floor(gaps / seg).sum()) * work
    if final > 0.0:
        n_full = math.floor(final / seg)
        useful += n_full * work + min(final - n_full * seg, work)
    return useful


def simulate_waste(
    s: Scenario,
    *,
    interval_s: float | None = None,
    horizon_s: float | None = None,
    replications: int = DEFAULT_SIM_REPLICATIONS,
    seed: int | None = 0,
    distribution: Literal["exponential", "weibull"] = "exponential",
    shape: float = 1.0,
    process: Literal["gpu", "job"] = "gpu",
    start: Literal["stationary", "fresh"] = "stationary",
) -> dict[str, SimResult]:
    """Monte-Carlo wasted fraction, ``{"periodic": ..., "jit": ..., "jit_inprocess": ...}``.

    Each replication draws one failure trace over ``horizon_s`` (default
    ``DEFAULT_SIM_FAILURES`` job MTBFs) and runs both policies on it; the CI is
    over replications.  See the module docstring for the failure processes.
    """
    reps = _positive_int("replications", replications)
    if reps < 2:
        raise ValueError(f"replications must be at least 2 for a CI, got {replications!r}")
    if distribution not in ("exponential", "weibull"):
        raise ValueError(f"distribution must be 'exponential' or 'weibull', got {distribution!r}")
    if process not in ("gpu", "job"):
        raise ValueError(f"process must be 'gpu' or 'job', got {process!r}")
    if start not in ("stationary", "fresh"):
        raise ValueError(f"start must be 'stationary' or 'fresh', got {start!r}")
    k = _positive("shape", shape)
    horizon = DEFAULT_SIM_FAILURES * s.job_mtbf_s if horizon_s is None else _positive("horizon_s", horizon_s)
    segs = {p: s.segments(p, interval_s if p == "periodic" else None) for p in ("periodic", "jit")}
    (_, d_ip), (p_fb, d_full) = s.inprocess_downtimes()
    rng = np.random.default_rng(seed)
    kind_rng = np.random.default_rng(None if seed is None else [seed, 46])
    wastes: dict[str, list[float]] = {"periodic": [], "jit": [], "jit_inprocess": []}
    n_fail = 0
    for _ in range(reps):
        f = _failure_times(rng, s.gpus, s.gpu_mtbf_s, horizon, distribution, k, process, start)
        n_fail += f.size
        for p, (w, c, d) in segs.items():
            wastes[p].append(1.0 - _useful_work(f, horizon, w, c, d) / horizon)
        d_each = np.where(kind_rng.random(f.size) < p_fb, d_full, d_ip)  # no spare: full restart
        useful = _useful_work(f, horizon, s.iter_s, s.jit_overhead * s.iter_s, d_each)
        wastes["jit_inprocess"].append(1.0 - useful / horizon)
    out: dict[str, SimResult] = {}
    t = _t975(reps - 1)
    for p, vals in wastes.items():
        a = np.asarray(vals)
        mean = float(a.mean())
        sd = float(a.std(ddof=1))
        hw = t * sd / math.sqrt(reps)
        out[p] = SimResult(mean, mean - hw, mean + hw, sd, reps, n_fail / reps)
    logger.debug(
        "simulate_waste N=%d dist=%s k=%g process=%s start=%s: %s",
        s.gpus, distribution, k, process, start, out,
    )
    return out
