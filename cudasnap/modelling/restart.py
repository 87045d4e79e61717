"""The downtime of a JIT in-process restart, as measured parts, and its spare pool.

A full restart (the ``jit`` policy of :mod:`cudasnap.modelling.analysis`) costs
``D + F + R`` per failure: detection, the JIT flush to storage, and a restart of every
process (new interpreters, imports, model build, process group, reload from storage).
An **in-process restart** (issue 46; ``cudasnap.distributed.inprocess``) keeps every
healthy process: the survivors leave the step they are in, re-form the process group with
a warm spare in the lost rank's place, and every rank restores the last completed step
from host memory (its own arena in shared memory, or a peer node's copy when a node was
lost). Its downtime is the sum of named parts (:class:`RestartParts`):

``detect_s``   the failure seen: a crashed process at once from its pid on its node; a
               lost node when its heartbeats go stale (``stale_s``, 1.5 s by default);
``regroup_s``  the process group of the next generation formed (abort the old one,
               initialise a new one on a fresh store prefix);
``takeover_s`` the warm spare joins: its Snapshotter takes the lost rank's lock and arena;
``restore_s``  the state put back from host memory into the live objects (no disk: the
               flush ``F`` is not paid);
``other_s``    a measured total that was not split into the parts above (0 by default).

The replay of at most one step is not a part: it is JIT's lost work, already in the
segment model (``w = T_it``).

Measured on this machine (2-core VM, CPU, gloo, 2026-12-07)
-----------------------------------------------------------
``tools/stacks/inprocess_harness.py`` (4 ranks + spares, a data-parallel MLP, SIGKILL at a
random step), the parts read off the processes' log timestamps (INFO logging on): kill ->
"lost, taken by spare" (detect) -> the last "group formed" (regroup) -> the spare's
Snapshotter found the arena (take-over) -> the spare "restored step" (restore).  Medians:

* one process killed (4 trials): 0.004 + 0.070 + 0.109 + 0.057 = 0.24 s
  (:data:`INPROCESS_PROCESS_CRASH`); ``bench/recovery.py`` measured kill -> every rank
  stepping at 0.21 s (2 ranks) and 0.22 s (4 ranks), the full restart under
  ``cudasnap run -- torchrun`` at 4.8 s and 7.7 s
  (``bench/results/recovery-2026-12-07-issue46.json``);
* one node of 2 lost (2 nodes x 2 ranks, 5 trials): 1.45 + 0.05 + 0.22 + 0.055 = 1.78 s
  (:data:`INPROCESS_NODE_LOSS`; the restore fetches the copy from the peer node's memory).

Past this machine: the re-formation term grows with the job (an assumption)
-----------------------------------------------------------------------------
Four gloo ranks form a group in 0.05-0.07 s. NCCL communicators of thousands of GPUs
take far longer, and an in-process restart has to build one that includes the spare:

* NVIDIA/nccl issue #1156 (a PyTorch distributed developer, January 2024): "2.5-minute init time
  at large scale (e.g. above certain K GPUs)", paid "at initial training launch or restart
  of training (e.g. to recover from GPU failure)";
* NVIDIA/nccl pull request #1789 (Meta, July 2025): initialisation "often several dozens of
  seconds at 100K scale" from two O(N^2) loops alone; ``ncclBuildRing`` saves 26 s at
  96K GPUs, ``initTransportsRank`` 11+ s at 48K.

No public figure gives the curve, so the default grows the re-formation linearly to
:data:`REGROUP_SECONDS_AT_100K` = 150 s (issue #1156's 2.5 minutes, put at 102,400 GPUs):
about 1.5 s at 1,024 GPUs, 15 s at 10,240, 150 s at 102,400 — more than the O(N^2) loops
of #1789 give below 100K, so it is conservative for the in-process policy.  It is a
parameter (``regroup_s_per_gpu``), not a measurement.

The restore measured here moved 0.1 MB per rank. A GPU's real state (tens of GB) takes
``state_gb / restore_gbps``: :func:`parts_for_state` charges that, at
:data:`DEFAULT_RESTORE_GBPS` = 10 GB/s per GPU by default (an assumption: below the 55 GB/s
pinned-copy ceiling measured on an H200, ``bench/RESULTS.md`` 2026-12-04, and below one
400 Gb/s NIC, 50 GB/s, that a peer node's copy crosses after a node loss).

Detection: a crashed process or a lost node is seen by the monitor (pid, heartbeat). A fault
that leaves the process alive but stuck (a hung collective) is seen only when the collective
times out, for this policy as for a full restart; the model does not split failures by kind
(``bench/goodput.py`` reports the variant with the full restart's ``D`` as detection).

Spares (an assumption, kept simple)
-----------------------------------
A spare unit absorbs one failure (a process, or a node's worth of ranks for a lost node).
The pool holds ``ceil(spares_per_1k * N / 1024)`` units; a unit used by a recovery comes
back after ``refill_s`` (the failed node repaired, or a replacement added by the
scheduler).  A failure that finds no spare falls back to a full restart (``D + F + R``).
With failures Poisson of rate ``N/m`` and each used spare away for ``refill_s``, the pool is
an M/G/S/S loss system and the fallback probability is Erlang's loss formula
``B(S, a)`` with ``a = refill_s * N / m`` (Erlang 1917; insensitive to the refill-time
distribution).  Failures are independent of the pool's state in the model; the defaults
(:data:`DEFAULT_SPARES_PER_1K` = 2 units per 1,024 GPUs, :data:`DEFAULT_SPARE_REFILL_SECONDS`
= 4 h) are assumptions, not reports.

A failure whose downtime is ``d_k`` with probability ``p_k`` (drawn independently per
failure, also for a failure during a downtime) gives the segment model of
:mod:`.analysis` exactly the constant downtime ``d_eff = -M ln(sum_k p_k exp(-d_k/M))``
(:func:`mixed_downtime`; the renewal argument of the module docstring of :mod:`.analysis`
with the downtime's expected length ``M (1/sum_k p_k e^{-d_k/M} - 1)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

__all__ = [
    "RestartParts",
    "INPROCESS_PROCESS_CRASH",
    "INPROCESS_NODE_LOSS",
    "REGROUP_SECONDS_AT_100K",
    "DEFAULT_REGROUP_SECONDS_PER_GPU",
    "DEFAULT_INPROCESS_PARTS",
    "DEFAULT_SPARES_PER_1K",
    "DEFAULT_SPARE_REFILL_SECONDS",
    "DEFAULT_RESTORE_GBPS",
    "parts_for_state",
    "erlang_b",
    "spare_count",
    "fallback_probability",
    "mixed_downtime",
    "parse_parts",
]


def _check(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return v


@dataclass(frozen=True)
class RestartParts:
    """The downtime of one in-process restart, in seconds, part by part (module doc).

    ``regroup_s_per_gpu`` grows the re-formation with the job: :meth:`at` gives the parts
    of a job of ``gpus`` GPUs, ``regroup_s + regroup_s_per_gpu * gpus``.
    """

    detect_s: float
    regroup_s: float
    takeover_s: float
    restore_s: float
    other_s: float = 0.0
    regroup_s_per_gpu: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _check(f.name, getattr(self, f.name)))

    @property
    def total(self) -> float:
        """The downtime: the sum of the parts (at the size the parts are for)."""
        return self.detect_s + self.regroup_s + self.takeover_s + self.restore_s + self.other_s

    def at(self, gpus: int) -> "RestartParts":
        """These parts for a job of ``gpus`` GPUs (the re-formation grown, no growth left)."""
        if isinstance(gpus, bool) or int(gpus) != gpus or gpus <= 0:
            raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
        return replace(self, regroup_s=self.regroup_s + self.regroup_s_per_gpu * int(gpus),
                       regroup_s_per_gpu=0.0)

    def as_dict(self) -> dict[str, float]:
        d = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        d["total_s"] = self.total
        return d


INPROCESS_PROCESS_CRASH = RestartParts(detect_s=0.004, regroup_s=0.070, takeover_s=0.109,
                                       restore_s=0.057)
"""One process killed, 4 gloo ranks on this machine (medians, module doc): 0.24 s."""

INPROCESS_NODE_LOSS = RestartParts(detect_s=1.45, regroup_s=0.05, takeover_s=0.22,
                                   restore_s=0.055)
"""One node of 2 lost (heartbeats stale after 1.5 s), restore from the peer node: 1.78 s."""

REGROUP_SECONDS_AT_100K: float = 150.0
"""Assumed re-formation of a 102,400-GPU group (NVIDIA/nccl #1156: 2.5 min "at large scale")."""

DEFAULT_REGROUP_SECONDS_PER_GPU: float = REGROUP_SECONDS_AT_100K / 102_400

DEFAULT_INPROCESS_PARTS = replace(INPROCESS_NODE_LOSS,
                                  regroup_s_per_gpu=DEFAULT_REGROUP_SECONDS_PER_GPU)
"""The model's default: every failure treated as a lost node (the slower path measured
here), the re-formation grown with the job (an assumption, module doc)."""

DEFAULT_SPARES_PER_1K: float = 2.0
"""Spare units per 1,024 GPUs of the job (an assumption: e.g. 2 spare 8-GPU nodes, 1.6%)."""

DEFAULT_SPARE_REFILL_SECONDS: float = 4 * 3600.0
"""Time until a used spare unit is back in the pool (an assumption)."""


DEFAULT_RESTORE_GBPS: float = 10.0
"""Per-GPU GB/s of a restore from host memory (own node or a peer's) at scale (an assumption)."""


def parts_for_state(state_gb: float, parts: RestartParts = DEFAULT_INPROCESS_PARTS,
                    restore_gbps: float = DEFAULT_RESTORE_GBPS) -> RestartParts:
    """``parts`` with the restore of ``state_gb`` per GPU at ``restore_gbps`` (never less
    than the restore in ``parts``)."""
    bw = _check("restore_gbps", restore_gbps)
    if bw <= 0.0:
        raise ValueError(f"restore_gbps must be positive, got {restore_gbps!r}")
    return replace(parts, restore_s=max(parts.restore_s, _check("state_gb", state_gb) / bw))


def erlang_b(servers: int, load: float) -> float:
    """Erlang's loss formula ``B(S, a)``: the chance that an arrival finds all ``S`` busy.

    Stable recursion ``B(0) = 1``, ``B(k) = a B(k-1) / (k + a B(k-1))``.
    """
    if isinstance(servers, bool) or int(servers) != servers or servers < 0:
        raise ValueError(f"servers must be a non-negative integer, got {servers!r}")
    a = _check("load", load)
    b = 1.0
    for k in range(1, int(servers) + 1):
        b = a * b / (k + a * b)
    return b


def spare_count(gpus: int, spares_per_1k: float) -> int:
    """Spare units of a job of ``gpus`` GPUs: ``ceil(spares_per_1k * gpus / 1024)``."""
    x = _check("spares_per_1k", spares_per_1k)
    return math.ceil(x * gpus / 1024.0 - 1e-12) if x > 0 else 0


def fallback_probability(gpus: int, job_mtbf_s: float, spares_per_1k: float | None,
                         refill_s: float) -> float:
    """Chance that a failure finds no spare and falls back to a full restart.

    ``spares_per_1k=None``: an unlimited pool (0). Else Erlang B of the pool's
    :func:`spare_count` with load ``refill_s / job_mtbf_s``.
    """
    if spares_per_1k is None:
        return 0.0
    m = float(job_mtbf_s)
    if not math.isfinite(m) or m <= 0.0:
        raise ValueError(f"job_mtbf_s must be a positive finite number, got {job_mtbf_s!r}")
    return erlang_b(spare_count(gpus, spares_per_1k), _check("refill_s", refill_s) / m)


def mixed_downtime(downtimes: list[tuple[float, float]], mtbf_s: float) -> float:
    """The constant downtime equivalent to ``[(probability, seconds), ...]`` (module doc).

    ``-M ln(sum p_k exp(-d_k / M))``; between the smallest and the largest ``d_k``, and
    ``sum p_k d_k`` to first order in ``d/M``.
    """
    m = float(mtbf_s)
    if not math.isfinite(m) or m <= 0.0:
        raise ValueError(f"mtbf_s must be a positive finite number, got {mtbf_s!r}")
    live = [(_check("probability", p), _check("downtime", d)) for p, d in downtimes if p > 0.0]
    if not live or abs(sum(p for p, _ in live) - 1.0) > 1e-9:
        raise ValueError(f"downtime probabilities must sum to 1, got {downtimes!r}")
    d0 = min(d for _, d in live)  # factor out the smallest: no underflow when d >> M
    return d0 - m * math.log(sum(p * math.exp(-(d - d0) / m) for p, d in live))


def parse_parts(text: str) -> RestartParts:
    """``"DETECT,REGROUP,TAKEOVER,RESTORE"`` seconds (as measured, no growth) to parts."""
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 4:
        raise ValueError("in-process parts must be four numbers DETECT,REGROUP,TAKEOVER,RESTORE "
                         f"(seconds), got {text!r}")
    return RestartParts(*vals)
