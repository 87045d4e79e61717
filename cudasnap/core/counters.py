"""The Snapshotter's counters: one dataclass, one field per figure ``stats()`` reports.

Call order: the facade makes one ``Counters`` and hands it to each component that
counts (the copier, the arena keeper, the layouts, the flusher, the restorer, the
early saver); each increments only the fields of its own mechanism, by attribute
(a misspelt name is an AttributeError, not a new key). ``Snapshotter.stats()`` calls
:meth:`Counters.summary` for the dict it returns (same keys and values as the
string-keyed dict it replaced).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class Counters:
    snapshots: int = 0              # copies handed to the engine (copier)
    skipped: int = 0                # boundaries not copied: busy slot, running copy, ...
    bytes: int = 0                  # the newest copy's data bytes
    boundary_ns: list[int] = field(default_factory=list)  # recent boundary() times
    fence_wait_ns: int = 0          # time the training thread waited on copies
    last_copy_seconds: float | None = None
    last_copy_gbps: float | None = None
    flushes: int = 0
    last_flush_seconds: float | None = None
    last_flush_path: str | None = None
    arena_setup_seconds: float | None = None
    health_events: int = 0
    restore: dict[str, object] | None = None  # what the last restore loaded: source, step, seconds, where
    layout_rebuilds: int = 0
    abandoned: int = 0              # copies a fence gave up on (wait_timeout_s)
    arena_regrowths: int = 0
    skipped_not_ready: int = 0      # boundaries before the arena was ready
    skipped_every: int = 0          # zero-overhead mode: boundaries not copied by design
    live_saves: int = 0             # JIT copies of the live state at a flush
    early_saves: int = 0            # synchronous snapshots before the arena was ready
    skipped_layout: int = 0         # boundaries while a large state's plan was built off-thread

    def record_boundary(self, t0: int) -> None:
        """One boundary's time since ``t0`` (perf_counter_ns); the newest 2-4 k kept."""
        ns = self.boundary_ns
        ns.append(time.perf_counter_ns() - t0)
        if len(ns) > 4096:
            del ns[:2048]

    def summary(self) -> dict[str, object]:
        """``stats()``'s counters: every field, with the boundary-time median (us) and the
        fence waits (s) in place of the raw ``boundary_ns`` / ``fence_wait_ns``."""
        s = {f.name: getattr(self, f.name) for f in fields(self)}
        ns = sorted(s.pop("boundary_ns"))
        s["boundary_us_median"] = ns[len(ns) // 2] / 1e3 if ns else None
        s["fence_wait_s"] = s.pop("fence_wait_ns") / 1e9
        return s
