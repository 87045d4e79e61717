"""The Snapshotter's constructor checks: each bad argument is a ConfigError naming it."""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..format.paths import is_url
from .rng import RNG_SOURCES


def check_options(*, num_slots: int, spare_slot: bool, keep: Any, chunk_bytes: int,
                  backend: str, snapshot_every: Any, rng_sources: tuple[str, ...]) -> None:
    """Raises ConfigError naming the first bad constructor argument."""
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) \
            or snapshot_every < 1:
        raise ConfigError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
    if num_slots < 2:
        raise ConfigError(f"num_slots must be >= 2, got {num_slots}")
    if num_slots + bool(spare_slot) > 8:
        raise ConfigError(f"num_slots must be <= {8 - bool(spare_slot)} (the arena holds at "
                          f"most 8 slots, spare_slot={bool(spare_slot)}), got {num_slots}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"keep must be an int >= 0 (0 keeps every snapshot), got {keep!r}")
    if chunk_bytes < 4096 or chunk_bytes % 4096:
        raise ConfigError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
    if backend not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
    bad = set(rng_sources) - set(RNG_SOURCES)
    if bad:
        raise ConfigError(f"unknown rng_sources {sorted(bad)}; use torch, cuda, numpy, python")


def check_url(directory: Any, world_size: int, fresh: bool) -> None:
    """An object-store URL is never moved aside: ``fresh`` is refused (any world size).

    Why refuse rather than move: an object store has no rename, so "aside" would be a
    copy of every object under ``.old-<time>/`` and a delete of the originals, one
    object at a time: minutes for a large snapshot, and a start killed half-way leaves
    the old steps half copied and half deleted (a COMMIT may survive its data; restore
    would skip such a step, but the old snapshots would not be kept whole as fresh
    promises). The fresh start (core.timeline.move_aside) also moves local files only. A
    new URL prefix is a fresh start that costs nothing and loses nothing.
    Multi-rank jobs are supported (cudasnap.storage.remote_ranks)."""
    if is_url(directory) and fresh:
        raise ConfigError(f"{directory}: fresh=True (CUDASNAP_FRESH, cudasnap run --fresh) "
                          "cannot move object-store snapshots aside (no rename in an object "
                          "store); start fresh under a new URL prefix instead, e.g. "
                          f"{str(directory).rstrip('/')}-2")
