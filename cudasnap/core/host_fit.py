"""Host-memory fit of the staging arenas and the ``snapshot_every`` pick (issue 15 target 7/5).

Each rank keeps one arena in /dev/shm of ``(num_slots + spare_slot)`` slots, each
about the rank's state (+1/64, a chunk of slack and its manifest area, as ``Snapshotter``
sizes it: cudasnap.core.slot_geometry).
tmpfs pages are RAM: the arenas of every rank on a node must fit both the free
space of /dev/shm and MemAvailable, with the live host state beside them.
"""
from __future__ import annotations

import os
from typing import TypedDict

from .. import config as cfg
from .cadence import smallest_k
from .slot_geometry import chunk_for, meta_floor, slot_capacity

GB = 1e9
DEFAULT_COPY_GBPS = 20.0  # device -> pinned host (PCIe Gen4 x16 ~25 GB/s)


class HostFit(TypedDict):
    """``host_fit``: the staging bytes one node needs against this host's limits."""

    ranks_per_node: int
    slots: int
    need_bytes: int
    shm_free_bytes: int | None
    mem_available_bytes: int | None
    fits: bool
    message: str


class EveryPick(TypedDict):
    """``pick_snapshot_every``: the k the overhead budget picks and what it costs."""

    snapshot_every: int
    copy_seconds: float
    crash_replay_max_seconds: float
    message: str


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shm_free_bytes(shm_dir: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def host_fit(state_gb: float, ranks_per_node: int, *, num_slots: int = 2, spare_slot: bool = True,
             shm_free: int | None = None, mem_available: int | None = None) -> HostFit:
    """Bytes the arenas of one node need vs what this host has; ``fits`` and a message."""
    slots = num_slots + (1 if spare_slot else 0)
    nbytes = int(state_gb * GB)
    per_slot = slot_capacity(nbytes, chunk_for(nbytes)) + meta_floor(nbytes)
    need = int(ranks_per_node * slots * per_slot)
    limits = {k: v for k, v in (("/dev/shm free", shm_free), ("MemAvailable", mem_available))
              if v is not None}
    short = {k: v for k, v in limits.items() if need > v}
    if not limits:
        msg = f"staging needs {need / GB:.3g} GB of host RAM per node; host limits unknown"
    elif short:
        lim = min(short.values())
        fewer = int(ranks_per_node * (slots - 1) * per_slot) if spare_slot else None
        msg = (f"DOES NOT FIT: {ranks_per_node} rank(s) x {slots} slots x {state_gb:.4g} GB = "
               f"{need / GB:.3g} GB of staging, but on this host "
               + ", ".join(f"{k} is {v / GB:.3g} GB" for k, v in short.items())
               + (f"; spare_slot=False needs {fewer / GB:.3g} GB" if fewer is not None else "")
               + ("" if fewer is not None and fewer <= lim else
                  "; shard the state over more nodes or enlarge /dev/shm"))
    else:
        msg = (f"fits: {need / GB:.3g} GB of staging (" + ", ".join(
            f"{k} {v / GB:.3g} GB" for k, v in limits.items()) + ")")
    return {"ranks_per_node": ranks_per_node, "slots": slots, "need_bytes": need,
            "shm_free_bytes": shm_free, "mem_available_bytes": mem_available,
            "fits": not short, "message": msg}


def pick_snapshot_every(state_gb: float, iter_seconds: float,
                        copy_gbps: float = DEFAULT_COPY_GBPS,
                        budget: float = cfg.OVERHEAD_BUDGET) -> EveryPick:
    """The k the overhead budget would pick (core.cadence.smallest_k, the same rule):
    a copy that outlasts k iterations stalls the next one by the difference, so the
    smallest k whose stall fits the budget; a crash replays <= k steps, a signal/hang/peer
    failure with a healthy device <= 1 (the JIT save reads the live state). A running
    Snapshotter measures the cost instead (``stats()["cadence"]``)."""
    copy_s = state_gb / copy_gbps
    k = smallest_k(lambda k: max(0.0, copy_s - k * iter_seconds), iter_seconds, budget) \
        or cfg.MAX_EVERY
    return {"snapshot_every": k, "copy_seconds": copy_s,
            "crash_replay_max_seconds": k * iter_seconds,
            "message": (f"snapshot_every={k}: one {copy_s:.3g} s copy per {k} iteration(s) of "
                        f"{iter_seconds:.4g} s; a crash replays <= {k} step(s) "
                        f"(<= {k * iter_seconds:.3g} s), a signal, hang or peer failure <= 1")}
