"""The overhead budget's cadence (cudasnap.core.cadence): k follows the measured cost of a
snapshot, with a clock the test drives (no timing of this machine is involved)."""
from __future__ import annotations

import math
from typing import Any

import pytest

from cudasnap import config as cfg
from cudasnap.core.cadence import PROBE_EVERY, Cadence, HostClock


class CostClock:
    """A step clock whose steps take ``base`` s, plus ``cost`` s after a boundary that copied."""

    def __init__(self, base: float, cost: float) -> None:
        self.base, self.cost = base, cost
        self.t = 0.0
        self.clock = HostClock(now=lambda: self.t)

    def mark(self, after_copy: bool) -> None:
        self.clock.mark(after_copy)

    def intervals(self) -> list[tuple[float, bool]]:
        return self.clock.intervals()

    def step(self, copied: bool) -> None:
        self.t += self.base + (self.cost if copied else 0.0)


def run(budget: float, base: float, cost: float, n: int) -> tuple[Cadence, list[bool]]:
    clock = CostClock(base, cost)
    cad = Cadence(None, budget, lambda: clock)
    taken = []
    for _ in range(n):
        copied = cad.take()
        taken.append(copied)
        clock.step(copied)
    return cad, taken


@pytest.mark.parametrize("base,cost", [(0.0295, 0.0008), (0.0295, 0.011), (0.1, 0.0)])
def test_k_holds_the_budget(base: float, cost: float) -> None:
    cad, taken = run(0.01, base, cost, 400)
    want = max(1, math.ceil(cost / (0.01 * base)))
    assert cad.k == min(want, cfg.MAX_EVERY), cad.info()
    tail = taken[-200:]
    # the overhead actually paid over the last 200 steps is within the budget
    paid = sum(tail) * cost / (len(tail) * base)
    assert paid <= 0.01 + 1e-9, (paid, cad.info())
    info = cad.info()
    assert info["budget"] == 0.01 and not info["fixed"]
    assert info["snapshot_ms"] == pytest.approx(cost * 1e3, abs=1e-6)
    assert info["overhead"] <= 0.01 + 1e-9


def test_k_is_capped_and_said(caplog: Any) -> None:
    caplog.set_level("WARNING", logger="cudasnap")
    cad, _ = run(0.01, 0.01, 0.05, 300)  # a copy costs 5 steps: k = 500 wanted
    assert cad.k == cfg.MAX_EVERY
    assert any("cannot be held at k <= 64" in r.getMessage() for r in caplog.records)


def test_k_follows_a_change_of_cost() -> None:
    clock = CostClock(0.03, 0.00085)  # 2.8%: k = 3
    cad = Cadence(None, 0.01, lambda: clock)
    for _ in range(200):
        clock.step(cad.take())
    assert cad.k == 3
    clock.cost = 0.0  # device staging made copies free: k goes back to 1
    for _ in range(600):  # (a cost measured at another k is trusted 256 boundaries)
        clock.step(cad.take())
    assert cad.k == 1


def test_at_k1_a_plain_step_is_timed_now_and_then() -> None:
    cad, taken = run(0.01, 0.1, 0.0, 400)
    assert cad.k == 1
    skipped = [i for i, t in enumerate(taken) if not t]
    late = [i for i in skipped if i > 100]
    assert late, "no plain step after warm-up: the base step time would go stale"
    assert all(b - a >= PROBE_EVERY - 1 for a, b in zip(late, late[1:])), late


def test_fixed_every_and_budget_off() -> None:
    cad = Cadence(4, 0.01, lambda: None)
    assert [cad.take() for _ in range(9)] == [True, False, False, False] * 2 + [True]
    assert cad.info()["fixed"] and cad.info()["budget"] is None
    off = Cadence(None, 0.0, lambda: None)
    assert all(off.take() for _ in range(10)) and off.k == 1


def test_every_boundary_until_the_cost_is_known_but_a_plain_step_now_and_then() -> None:
    cad = Cadence(None, 0.01, lambda: None)  # the backend is not known yet: no clock
    assert [cad.take() for _ in range(16)] == ([True] * 7 + [False]) * 2
    assert cad.info()["overhead"] is None and cad.k == 1


def test_auto_copies_every_boundary_on_the_cpu_backend() -> None:
    """overhead_budget unset: the CPU backend (a host clock) copies every boundary; the
    CUDA backend holds config.OVERHEAD_BUDGET."""
    cpu = Cadence(None, None, lambda: HostClock())
    assert all(cpu.take() for _ in range(100))
    assert cpu.info()["fixed"] and cpu.info()["budget"] is None
    clock = CostClock(0.03, 0.00085)  # not a HostClock: stands for the CUDA clock here
    gpu = Cadence(None, None, lambda: clock)
    for _ in range(200):
        clock.step(gpu.take())
    assert gpu.info()["budget"] == cfg.OVERHEAD_BUDGET and gpu.k == 3


@pytest.mark.parametrize("kw,msg", [({"overhead_budget": 1.0}, "overhead_budget"),
                                    ({"overhead_budget": -0.1}, "overhead_budget"),
                                    ({"overhead_budget": True}, "overhead_budget"),
                                    ({"device_staging": -1}, "device_staging"),
                                    ({"device_staging": "some"}, "device_staging"),
                                    ({"snapshot_every": 0}, "snapshot_every")])
def test_bad_keywords_are_named(kw: dict[str, Any], msg: str) -> None:
    from cudasnap.errors import ConfigError

    base = dict(num_slots=2, spare_slot=True, keep=3, chunk_bytes=4096, backend="auto",
                snapshot_every=None, rng_sources=cfg.RNG_SOURCES)
    base.update(kw)
    with pytest.raises(ConfigError, match=msg):
        cfg.check_options(**base)


@pytest.mark.parametrize("value,want", [("", None), ("auto", None), ("0", 0.0), ("0.05", 0.05)])
def test_budget_env(value: str, want: float) -> None:
    assert cfg.Settings.from_env({"CUDASNAP_OVERHEAD_BUDGET": value}).overhead_budget == want


@pytest.mark.parametrize("value", ["x", "1.5", "-1"])
def test_budget_env_bad(value: str) -> None:
    from cudasnap.errors import ConfigError

    with pytest.raises(ConfigError, match="CUDASNAP_OVERHEAD_BUDGET"):
        cfg.Settings.from_env({"CUDASNAP_OVERHEAD_BUDGET": value})


@pytest.mark.parametrize("value,want", [("", 0), ("auto", "auto"), ("1048576", 1048576)])
def test_staging_env(value: str, want: Any) -> None:
    assert cfg.Settings.from_env({"CUDASNAP_DEVICE_STAGING": value}).device_staging == want


def test_a_copy_longer_than_k_steps_is_charged_to_that_k() -> None:
    """A copy of J s (the drain to the host) delays the next copy's boundary when k steps
    are shorter than J: cost(k) = fixed + max(0, J - k T). Device staging every step on the
    timing model: J = 31 ms, T = 29.5 ms, fixed 0.1 ms -> k = 1 costs 1.6 ms (5.4%), k = 2
    0.1 ms (0.17%): the cadence settles at 2 (no 1 <-> 6 swing), retrying k = 1 only when
    its old measurement expires, and pays about its budget over the run."""
    base, fixed, job = 0.0295, 0.0001, 0.031
    clock = CostClock(base, 0.0)
    cad = Cadence(None, 0.01, lambda: clock)
    last = None
    ks, extras = [], []
    for i in range(1200):
        copied = cad.take()
        extra = 0.0
        if copied:
            gap = i - last if last is not None else 99
            extra = fixed + max(0.0, job - gap * base)
            last = i
        clock.t += base + extra
        ks.append(cad.k)
        extras.append(extra)
    assert cad.k == 2, cad.info()
    assert set(ks[300:]) <= {1, 2} and ks[300:].count(1) <= 40, ks[300:].count(1)
    assert sum(extras[300:]) / (900 * base) <= 0.01, sum(extras[300:]) / (900 * base)


def test_a_distributed_job_copies_every_boundary_unless_k_is_fixed() -> None:
    """Per-rank budgets would pick different boundaries on different ranks (a flush round
    then finds no step every rank holds): coordinated() turns the budget off."""
    clock = CostClock(0.03, 0.0009)
    cad = Cadence(None, 0.01, lambda: clock)
    for _ in range(50):
        clock.step(cad.take())
    assert cad.k > 1
    cad.coordinated()
    assert cad.k == 1 and cad.info()["fixed"] and all(cad.take() for _ in range(10))
    fixed = Cadence(4, 0.01, lambda: None)
    fixed.coordinated()
    assert fixed.k == 4 and [fixed.take() for _ in range(4)] == [True, False, False, False]


def test_a_chosen_copy_that_did_not_happen_is_a_plain_step() -> None:
    """A boundary take() chose to copy but the Copier could not (no arena yet, busy
    slots): the step after it is timed as a plain one, not as a copy's cost."""
    def run(report: bool) -> Cadence:
        clock = CostClock(0.03, 0.0)
        cad = Cadence(None, 0.01, lambda: clock)
        for _ in range(100):
            chose = cad.take()
            if not report:
                cad.copied(False)
            clock.t += 0.03 + (0.01 if chose else 0.0)  # slow steps after the chosen ones
        return cad

    assert run(report=True).k > 2  # counted as copies: a costly copy, k grows
    skipped = run(report=False)
    assert skipped.k == 1 and skipped.info()["overhead"] is None  # never a copy measured
