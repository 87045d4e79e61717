"""Cadence: which boundaries copy the state, fixed (``snapshot_every=k``) or held to an overhead budget.

The budget (``overhead_budget=0.01``: snapshots may cost 1% of step time) is held by
measurement, not by a model: a ``StepClock`` times each step between two boundaries
(on a GPU, timing events on the compute stream, so a stall at a fence and an idle GPU
behind a blocked host both count; on the CPU backend, host time), and the steps are
split by whether the boundary before them copied. The median extra time of a step
after a copy is what one snapshot costs (``o``); with ``T`` the median step without
one, copying every k-th boundary costs ``o / (k T)``. ``o`` depends on k (a copy
that outlasts k steps makes the next boundary wait for it), so it is measured at each
k tried: k is the smallest with ``o(k) <= budget * k * T``, where an untried k is
assumed to cost no more than the nearest tried one above it (then tried), 1 ..
``config.MAX_EVERY``. It starts at k = 1, every boundary copied; at k = 1 it skips one
boundary in ``PROBE_FIRST`` (then ``PROBE_EVERY``) to time a step without a copy.

The default (``overhead_budget`` unset) holds ``config.OVERHEAD_BUDGET`` on the CUDA
backend and copies every boundary on the CPU backend, where the copy shares the cores
with training and a skipped boundary would only trade replay for a little CPU time; an
``overhead_budget`` given holds on either.

A skipped boundary is not lost: until the next optimizer step the live state IS that
step, and a flush (a signal, a health event, a hang) copies it then (replay <= 1; see
``Copier.copy_live``). Only a process killed outright (SIGKILL, a segfault) replays
up to k steps, from the newest copy.

Call order: the Copier calls :meth:`Cadence.take` once at the start of every boundary
(it marks the clock, then answers whether this boundary copies); ``info()`` any time.
The clock is made on first use by ``clock_for`` (None until the backend is known);
tests pass their own.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .. import config as cfg

if TYPE_CHECKING:  # type-only: torch is imported when a CUDA clock is made
    import torch

    from .backend import Backend

log = logging.getLogger("cudasnap")

PROBE_EVERY = 64   # at k = 1: one boundary in this many is skipped to time a plain step
PROBE_FIRST = 8    # ... one in this many until MIN_SAMPLES plain steps are timed
SAMPLES = 16       # steps of each kind the medians are taken over
MIN_SAMPLES = 3    # of each kind before k follows the measurement
FORGET_AFTER = 256  # boundaries: a cost measured at another k is measured anew after this


class StepClock(Protocol):
    """Times the steps between boundaries.

    Call order: ``mark(after_copy)`` at the start of every boundary (``after_copy``: the
    previous boundary copied); ``intervals()`` returns ``(seconds, after_copy)`` of each
    step whose end is known by now, each once, oldest first."""

    def mark(self, after_copy: bool) -> None: ...

    def intervals(self) -> list[tuple[float, bool]]: ...


class HostClock:
    """Host time between boundaries (the CPU backend: training runs on the host)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._last: float | None = None
        self._out: list[tuple[float, bool]] = []

    def mark(self, after_copy: bool) -> None:
        t = self._now()
        if self._last is not None:
            self._out.append((t - self._last, after_copy))
        self._last = t

    def intervals(self) -> list[tuple[float, bool]]:
        out, self._out = self._out, []
        return out


class CudaClock:
    """Device time between boundaries: a timing event recorded on the current stream at
    each boundary, read once it has completed (never waited for)."""

    MAX_PENDING = 64

    def __init__(self, device: int) -> None:
        import torch

        self._torch = torch
        self._device = device  # the state's device: its current stream is timed
        self._pending: deque[tuple[torch.cuda.Event, bool]] = deque()
        self._free: list[torch.cuda.Event] = []

    def mark(self, after_copy: bool) -> None:
        torch = self._torch
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # the legacy stream while a blocking stream captures
            capturing = True
        if capturing:  # an event recorded now would join the graph: no interval spans it
            self._free.extend(ev for ev, _ in self._pending)
            self._pending.clear()
            return
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))
        self._pending.append((ev, after_copy))
        if len(self._pending) > self.MAX_PENDING:
            self._free.append(self._pending.popleft()[0])

    def intervals(self) -> list[tuple[float, bool]]:
        out = []
        p = self._pending
        while len(p) >= 2 and p[1][0].query():
            out.append((p[0][0].elapsed_time(p[1][0]) / 1e3, p[1][1]))
            self._free.append(p.popleft()[0])
        return out


class Cadence:
    def __init__(self, every: int | None, budget: float | None,
                 clock_for: Callable[[], StepClock | None]) -> None:
        # snapshot_every given: that k; budget 0: every boundary; else the budget's k.
        # budget None ("auto"): config.OVERHEAD_BUDGET on the CUDA backend, every boundary
        # on the CPU backend (decided when the clock is made: a HostClock means CPU).
        self.fixed: int | None = every if every is not None else \
            1 if budget is not None and budget <= 0 else None
        self.budget = (cfg.OVERHEAD_BUDGET if budget is None else budget) \
            if self.fixed is None else 0.0
        self._auto = every is None and budget is None
        self.k = self.fixed or 1  # every boundary until a copy's cost is known
        self._clock_for = clock_for
        self._clock: StepClock | None = None
        self._since = 1 << 30  # the first boundary copies
        self._last_copied = False
        self._boundaries = 0
        self._plain: deque[float] = deque(maxlen=SAMPLES)   # steps after a skipped boundary
        self._copied: deque[float] = deque(maxlen=SAMPLES)  # steps after a copy
        self._plain_at = 0  # boundary of the newest plain step
        self._probe_at = 0  # boundary of the newest skip made to time one
        self._capped = False
        # k -> (the measured extra time of a step after a copy, the boundary it was measured at)
        self._cost_at: dict[int, tuple[float, int]] = {}

    def coordinated(self) -> None:
        """A distributed job (a coordinator is attached): every rank must copy the same
        boundaries, which per-rank budgets would not agree on, so the budget is not used
        (every boundary, unless ``snapshot_every`` fixed k for all ranks); said once."""
        if self.fixed is None:
            log.info("cudasnap: overhead budget off in a distributed job (each rank would "
                     "pick its own boundaries): every boundary is copied; snapshot_every=k "
                     "sets one cadence for all ranks")
            self.fixed, self.k, self.budget = 1, 1, 0.0

    def copied(self, yes: bool) -> None:
        """The boundary ``take()`` chose to copy was not copied after all (no arena yet, a
        plan being built, busy slots, graph capture): its step counts as a plain one."""
        self._last_copied = yes

    def take(self) -> bool:
        """At the start of a boundary: whether it copies (and the step clock's mark)."""
        self._boundaries += 1
        if self.fixed is None:
            self._measure()
        self._since += 1
        k = self.k
        probe = PROBE_FIRST if len(self._plain) < MIN_SAMPLES else PROBE_EVERY
        if self.fixed is None and k == 1 and \
                self._boundaries - max(self._plain_at, self._probe_at) >= probe:
            k = 2  # a plain step now and then: the step time without a copy
            self._probe_at = self._boundaries
        copy = self._since >= k
        if copy:
            self._since = 0
        self._last_copied = copy
        return copy

    def _measure(self) -> None:
        if self._clock is None:
            self._clock = self._clock_for()
            if self._clock is None:
                return
            if self._auto and isinstance(self._clock, HostClock):
                log.debug("cudasnap: CPU backend: every boundary is copied (overhead_budget "
                          "unset; pass it to hold one)")
                self.fixed, self.k, self.budget = 1, 1, 0.0
                return
        try:
            self._clock.mark(self._last_copied)
            got = self._clock.intervals()
        except RuntimeError as e:  # a CUDA error of the timing events: stop measuring
            log.warning("cudasnap: the overhead budget's step clock failed (%s); the cadence "
                        "stays at k=%d", e, self.k)
            self.fixed = self.k
            return
        for secs, after_copy in got:
            if after_copy:
                self._copied.append(secs)
            else:
                self._plain.append(secs)
                self._plain_at = self._boundaries
        for kk in [kk for kk, (_, at) in self._cost_at.items()
                   if kk != self.k and self._boundaries - at > FORGET_AFTER]:
            del self._cost_at[kk]  # measured long ago: the run may have changed since
        if len(self._plain) < MIN_SAMPLES or len(self._copied) < MIN_SAMPLES:
            return
        base = statistics.median(self._plain)
        cost = max(0.0, statistics.median(self._copied) - base)
        prev = self._cost_at.get(self.k, (None, 0))[0]
        if prev is not None and abs(cost - prev) > 0.5 * max(cost, prev) + 0.001 * base:
            self._cost_at.clear()  # the cost changed (staging, state size): the others too
        self._cost_at[self.k] = (cost, self._boundaries)
        k = self._pick(base)
        if k != self.k:
            log.info("cudasnap: snapshot every %d boundaries (at k=%d a copy cost %.3g ms, a "
                     "step %.3g ms; budget %.2g%%)", k, self.k, cost * 1e3, base * 1e3,
                     self.budget * 100)
            self.k = k
            self._copied.clear()  # what a copy costs depends on k: measure it anew

    def _pick(self, base: float) -> int:
        """The smallest k whose cost fits the budget: measured where it was (a copy that
        cannot finish within k steps costs more at that k), else assumed no larger than
        at the nearest measured k above it (tried, then known)."""
        known = sorted((kk, c) for kk, (c, _) in self._cost_at.items())

        def cost_of(k: int) -> float:
            above = [c for kk, c in known if kk >= k]
            return above[0] if above else known[-1][1]

        k = smallest_k(cost_of, base, self.budget)
        if k is not None:
            self._capped = False
            return k
        if not self._capped:
            cost = cost_of(cfg.MAX_EVERY)
            log.warning("cudasnap: a snapshot costs %.3g ms against a %.3g ms step; the %.2g%% "
                        "overhead budget cannot be held at k <= %d (%.2g%% there). Device "
                        "staging (device_staging=) makes a snapshot cheaper", cost * 1e3,
                        base * 1e3, self.budget * 100, cfg.MAX_EVERY,
                        100 * cost / (cfg.MAX_EVERY * base))
            self._capped = True
        return cfg.MAX_EVERY

    def info(self) -> dict[str, object]:
        """k, the budget and what was measured (``overhead``: the share of step time the
        snapshots cost at this k; None until measured)."""
        out: dict[str, object] = {"k": self.k, "budget": self.budget if self.fixed is None else None,
                               "fixed": self.fixed is not None, "overhead": None,
                               "step_ms": None, "snapshot_ms": None}
        cost = self._cost_at.get(self.k, (None, 0))[0]
        if len(self._plain) >= MIN_SAMPLES and cost is not None:
            base = statistics.median(self._plain)
            out.update(step_ms=base * 1e3, snapshot_ms=cost * 1e3,
                       overhead=cost / (self.k * base) if base > 0 else None)
        return out


def smallest_k(cost_of: Callable[[int], float], step_s: float, budget: float,
               k_max: int = cfg.MAX_EVERY) -> int | None:
    """The smallest k in 1 .. ``k_max`` with ``cost_of(k) <= budget * k * step_s`` (the
    extra time one copy costs at cadence k, within the budget's share of k steps), or
    None. The cadence's choice and ``cudasnap advise``'s (core.host_fit)."""
    if step_s <= 0:
        return 1
    for k in range(1, k_max + 1):
        if cost_of(k) <= budget * k * step_s:
            return k
    return None


def clock_for(backend: Backend) -> Callable[[], StepClock | None]:
    """The clock of ``backend`` (core.backend.Backend), once it has resolved its engine."""
    def make() -> StepClock | None:
        if backend.name is None:
            return None
        return CudaClock(backend.cuda.index) if backend.cuda is not None else HostClock()
    return make
