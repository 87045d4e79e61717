"""Tests of cudasnap.modelling.analysis (intervals, closed forms), .simulate (Monte-Carlo) and .advice."""

from __future__ import annotations

import math

import pytest

from cudasnap.modelling import analysis as an
from cudasnap.modelling import presets
from cudasnap.modelling.advice import advise, format_advice
from cudasnap.modelling.analysis import (
    Scenario,
    compare,
    daly_interval,
    expected_lost_work,
    jit_waste,
    periodic_waste,
    segment_waste,
    young_interval,
)
from cudasnap.modelling.presets import KOKOLIS_GPU_MTBF_HOURS, LLAMA3_GPU_MTBF_HOURS
from cudasnap.modelling.simulate import simulate_waste

HOUR = 3600.0


def llama(gpus: int = 16_384, **kw: float) -> Scenario:
    base = dict(iter_s=8.0, checkpoint_s=30.0, flush_s=60.0, restart_s=300.0, detect_s=60.0)
    base.update(kw)
    return Scenario.from_hours(gpus, LLAMA3_GPU_MTBF_HOURS, **base)


# ---------------------------------------------------------------- presets
def test_presets_arithmetic() -> None:
    # 16,384 GPUs * 54 days * 24 h / 419 interruptions
    assert LLAMA3_GPU_MTBF_HOURS == pytest.approx(50_677.0, abs=1.0)
    assert presets.LLAMA3_405B.job_mtbf_hours == pytest.approx(1296 / 419)
    assert presets.LLAMA3_405B.gpu_mtbf_hours == pytest.approx(LLAMA3_GPU_MTBF_HOURS)
    assert presets.LLAMA3_405B.gpu_failure_rate_per_hour == pytest.approx(1.973e-5, rel=1e-3)
    assert KOKOLIS_GPU_MTBF_HOURS == pytest.approx(8_089.6)
    assert presets.KOKOLIS_RSC_1024.gpu_mtbf_hours == pytest.approx(8_089.6)
    assert set(presets.PRESETS) == {"llama3", "kokolis"}


# ---------------------------------------------------------------- intervals
def test_young_hand_values() -> None:
    # C = 30 s, M = 3 h = 10,800 s: sqrt(2 * 30 * 10800) = sqrt(648000)
    assert young_interval(30.0, 10_800.0) == pytest.approx(804.984472, rel=1e-9)
    assert young_interval(50.0, 100.0) == pytest.approx(100.0)


def test_daly_hand_values() -> None:
    # x = C/2M = 30/21600; sqrt(648000) * (1 + sqrt(x)/3 + x/9) - 30
    x = 30.0 / 21_600.0
    assert x == pytest.approx(1.388889e-3, rel=1e-6)
    assert daly_interval(30.0, 10_800.0) == pytest.approx(785.1087, abs=1e-3)
    assert daly_interval(30.0, 10_800.0) == pytest.approx(
        804.984472 * (1 + math.sqrt(x) / 3 + x / 9) - 30.0, rel=1e-9
    )
    # C = M: sqrt(2) M (1 + sqrt(0.5)/3 + 0.5/9) - M = 0.826115 M
    assert daly_interval(1000.0, 1000.0) == pytest.approx(826.115, abs=1e-2)
    # C >= 2M: tau = M
    assert daly_interval(3000.0, 1000.0) == 1000.0
    assert daly_interval(2000.0, 1000.0) == 1000.0


def test_daly_tends_to_young_for_small_c() -> None:
    m = 10_000.0 * HOUR
    for c in (1.0, 0.1, 0.01):
        assert daly_interval(c, m) / young_interval(c, m) == pytest.approx(1.0, abs=1e-3)
    ratios = [abs(daly_interval(c, m) / young_interval(c, m) - 1) for c in (100.0, 10.0, 1.0)]
    assert ratios[0] > ratios[1] > ratios[2]


def test_daly_interval_near_optimal_for_exact_model() -> None:
    s = llama()
    tau = daly_interval(s.checkpoint_s, s.job_mtbf_s)
    best = periodic_waste(s, tau)
    for f in (0.7, 0.85, 1.15, 1.3):
        assert periodic_waste(s, tau * f) > best


# ---------------------------------------------------------------- closed forms
def test_expected_lost_work() -> None:
    assert expected_lost_work(10.0, 1e9) == pytest.approx(5.0, rel=1e-6)
    # exact E[X | X < L] for L = M: M - M/(e - 1)
    assert expected_lost_work(1.0, 1.0) == pytest.approx(1 - 1 / (math.e - 1))
    assert expected_lost_work(100.0, 1000.0) < 50.0


def test_first_order_matches_exact_when_rare() -> None:
    s = llama(64)
    assert periodic_waste(s, exact=False) == pytest.approx(periodic_waste(s), rel=0.02)
    assert jit_waste(s, exact=False) == pytest.approx(jit_waste(s), rel=0.02)
    assert segment_waste(1.0, 1e9, 0.0, 1.0, exact=False) == 1.0  # clipped


def test_jit_waste_increases_with_d_f_r() -> None:
    base = llama()
    w0 = jit_waste(base)
    for field in ("detect_s", "flush_s", "restart_s"):
        prev = w0
        for extra in (1.0, 10.0, 100.0):
            s = Scenario(**{**base.__dict__, field: getattr(base, field) + extra})
            w = jit_waste(s)
            assert w > prev, field
            prev = w
    # and with the steady overhead
    assert jit_waste(Scenario(**{**base.__dict__, "jit_overhead": 0.01})) > w0


def test_jit_beats_periodic_at_scale() -> None:
    s = llama(16_384)  # Llama 3 rate, C = 30 s
    r = compare(s)
    assert r["jit"]["wasted_fraction"] < r["periodic"]["wasted_fraction"]
    assert r["ratio_periodic_to_jit"] > 2.0
    assert r["job_mtbf_hours"] == pytest.approx(1296 / 419)
    assert r["periodic"]["wasted_gpu_hours_per_day"] == pytest.approx(
        r["periodic"]["wasted_fraction"] * 16_384 * 24
    )


# ---------------------------------------------------------------- simulation
SIM_CASES = [
    llama(16_384),
    Scenario.from_hours(1_024, KOKOLIS_GPU_MTBF_HOURS, iter_s=30.0, checkpoint_s=120.0,
                        flush_s=240.0, restart_s=600.0, detect_s=120.0, jit_overhead=0.01),
    llama(131_072, checkpoint_s=300.0, flush_s=600.0),  # waste ~ 50%: far from first order
]


@pytest.mark.parametrize("case", range(len(SIM_CASES)))
def test_closed_form_within_mc_ci_exponential(case: int) -> None:
    s = SIM_CASES[case]
    cf = compare(s)
    sim = simulate_waste(s, seed=1234 + case)
    for p in ("periodic", "jit"):
        r = sim[p]
        assert r.replications == an.DEFAULT_SIM_REPLICATIONS
        assert r.ci_low < r.mean < r.ci_high
        assert r.half_width < 0.05 * r.mean  # the check is meaningful
        assert r.contains(cf[p]["wasted_fraction"]), (p, cf[p]["wasted_fraction"], r)


def test_simulation_is_seeded() -> None:
    s = llama(4096)
    a = simulate_waste(s, seed=7, replications=4)
    b = simulate_waste(s, seed=7, replications=4)
    assert a == b


def test_weibull_k1_reduces_to_exponential() -> None:
    s = llama(4096)
    cf = compare(s)
    exp = simulate_waste(s, seed=11)
    for start in ("stationary", "fresh"):
        for process in ("gpu", "job"):
            wb = simulate_waste(s, seed=12, distribution="weibull", shape=1.0,
                                process=process, start=start)
            for p in ("periodic", "jit"):
                assert wb[p].contains(cf[p]["wasted_fraction"]), (start, process, p)
                # two independent estimates of the same quantity
                diff = abs(wb[p].mean - exp[p].mean)
                assert diff < math.hypot(wb[p].half_width, exp[p].half_width) * 1.5
            assert wb["jit"].failures_per_replication == pytest.approx(an.DEFAULT_SIM_FAILURES, rel=0.03)


def test_weibull_shape_below_one() -> None:
    s = llama(16_384)
    cf = compare(s)
    # Stationary fleet: mean rate N/m for any k, Poisson-like at large N.
    st = simulate_waste(s, seed=5, distribution="weibull", shape=0.7)
    for p in ("periodic", "jit"):
        assert st[p].ci_low < st[p].ci_high
        assert abs(st[p].mean - cf[p]["wasted_fraction"]) < 3 * st[p].half_width
    assert st["jit"].failures_per_replication == pytest.approx(an.DEFAULT_SIM_FAILURES, rel=0.03)
    # Fresh fleet, decreasing hazard: expected failures >= N H / m, so more waste.
    fr = simulate_waste(llama(2048), seed=6, distribution="weibull", shape=0.7, start="fresh")
    cf2 = compare(llama(2048))
    assert fr["jit"].failures_per_replication > 1.2 * an.DEFAULT_SIM_FAILURES
    for p in ("periodic", "jit"):
        assert fr[p].ci_low > cf2[p]["wasted_fraction"]
    # job-level renewal runs and reports a CI
    jl = simulate_waste(s, seed=8, distribution="weibull", shape=0.7, process="job")
    assert all(0.0 < jl[p].ci_low < jl[p].ci_high < 1.0 for p in jl)


# ---------------------------------------------------------------- advise
def test_advise_recommends_jit_at_scale() -> None:
    d = advise(16_384, LLAMA3_GPU_MTBF_HOURS, 8.0, 60.0)  # C = 30 s, F = 60 s
    assert d["checkpoint_seconds"] == pytest.approx(60.0 / an.DEFAULT_CHECKPOINT_GBPS)
    assert d["flush_seconds"] == pytest.approx(60.0 / an.DEFAULT_FLUSH_GBPS)
    assert d["recommendation"] == "jit"
    assert d["jit"]["wasted_fraction"] < d["periodic"]["wasted_fraction"]
    assert d["periodic"]["interval_seconds"] == pytest.approx(
        daly_interval(30.0, LLAMA3_GPU_MTBF_HOURS * HOUR / 16_384))
    assert d["reasons"] and all(isinstance(r, str) for r in d["reasons"])
    text = format_advice(d)
    assert "Recommendation: jit" in text and "16384 GPUs" in text


def test_advise_job_mtbf_option() -> None:
    a = advise(16_384, LLAMA3_GPU_MTBF_HOURS, 8.0, 60.0)
    b = advise(16_384, 1296 / 419, 8.0, 60.0, per_gpu=False)
    assert b["job_mtbf_hours"] == pytest.approx(a["job_mtbf_hours"])
    assert b["jit"]["wasted_fraction"] == pytest.approx(a["jit"]["wasted_fraction"])


def test_advise_recommends_periodic_when_jit_overhead_dominates() -> None:
    d = advise(8, LLAMA3_GPU_MTBF_HOURS, 8.0, 60.0, jit_overhead=0.01)
    assert d["recommendation"] == "periodic"
    assert d["periodic"]["wasted_fraction"] < d["jit"]["wasted_fraction"]
    assert "Recommendation: periodic" in format_advice(d)


def test_advise_measured_costs() -> None:
    d = advise(4096, LLAMA3_GPU_MTBF_HOURS, 8.0, 60.0, checkpoint_seconds=5.0, flush_seconds=3.0)
    assert d["checkpoint_seconds"] == 5.0 and d["flush_seconds"] == 3.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(gpus=0), "gpus"),
        (dict(gpus=-8), "gpus"),
        (dict(gpus=2.5), "gpus"),
        (dict(mtbf_hours=0.0), "mtbf_hours"),
        (dict(mtbf_hours=-1.0), "mtbf_hours"),
        (dict(iter_seconds=-1.0), "iter_seconds"),
        (dict(state_gb=-1.0), "state_gb"),
        (dict(state_gb=0.0), "state_gb"),
        (dict(restart_seconds=-1.0), "restart_seconds"),
        (dict(detect_seconds=-0.5), "detect_seconds"),
        (dict(checkpoint_gbps=0.0), "checkpoint_gbps"),
        (dict(flush_gbps=-2.0), "flush_gbps"),
        (dict(jit_overhead=1.5), "jit_overhead"),
        (dict(checkpoint_seconds=-3.0), "checkpoint_seconds"),
        (dict(flush_seconds=-3.0), "flush_seconds"),
    ],
)
def test_advise_bad_inputs(kwargs: dict, name: str) -> None:
    args = dict(gpus=64, mtbf_hours=50_000.0, iter_seconds=8.0, state_gb=60.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        advise(**args)


def test_scenario_and_interval_bad_inputs() -> None:
    with pytest.raises(ValueError, match="gpus"):
        llama(0)
    with pytest.raises(ValueError, match="restart_s"):
        llama(restart_s=-1.0)
    with pytest.raises(ValueError, match="checkpoint_s"):
        young_interval(-1.0, 10.0)
    with pytest.raises(ValueError, match="mtbf_s"):
        daly_interval(1.0, 0.0)
    with pytest.raises(ValueError, match="replications"):
        simulate_waste(llama(), replications=1)
    with pytest.raises(ValueError, match="shape"):
        simulate_waste(llama(), distribution="weibull", shape=0.0)
