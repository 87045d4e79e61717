"""The geometry of a staging slot: its chunk size, data and manifest capacities (no torch).

Small states get small slots: every slot carries one chunk of slack and a manifest area, so
with a fixed 4 MiB chunk and a 1 MiB manifest floor a 0.6 MB state cost ~6 MB a slot (issue
35 item 5). The automatic chunk (``Snapshotter(chunk_bytes=None)``, the default) is about
a quarter of the slot's bytes (a power of two times 4 KiB, at most ``config.CHUNK_BYTES``:
states of 16 MiB and more keep 4 MiB), and the manifest floor a quarter of the state
(64 KiB .. 1 MiB); the CRC32C stays per chunk. Guest arenas of node-loss replication take the
sender's geometry (cudasnap.distributed.replica_store.make_arena), so they follow too.

Used by cudasnap.core.arena_size (the estimate at construction), cudasnap.core.copy_plan (the
copy plan's chunk), cudasnap.core.arena_keeper (the arena made for a plan) and
cudasnap.core.host_fit (the memory a node needs); ``arena_slots``: the slot facts of
``stats()`` (the ArenaKeeper).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import config as cfg

if TYPE_CHECKING:
    from cudasnap._C import Arena

PAGE = 4096
MIN_META = 1 << 20  # the manifest floor of a slot of 4 MiB and more
SMALL_META = 64 << 10  # ... and its lowest, for a tiny state
# The automatic chunk: about 1/4 of a slot's bytes. Not less: the CUDA engine puts a progress
# mark (an event, a split copy) on chunk boundaries, up to 16 of them, which pay off only
# for a copy that lasts; the CPU engine's workers still get a chunk each.
CHUNKS_PER_SLOT = 4


def chunk_for(nbytes: int, limit: int = cfg.CHUNK_BYTES) -> int:
    """The automatic chunk size of a slot of ``nbytes``: the power of two times 4 KiB
    nearest above ``nbytes / CHUNKS_PER_SLOT``, at most ``limit`` (a multiple of 4096, as
    the arena requires; 4 MiB by default, reached at 16 MiB)."""
    want = -(-max(0, nbytes) // CHUNKS_PER_SLOT)
    chunk = PAGE
    while chunk < want and chunk < limit:
        chunk *= 2
    return min(chunk, limit)


def slot_capacity(nbytes: int, chunk_bytes: int) -> int:
    """Data bytes per slot for a plan of ``nbytes``: headroom for small growth."""
    cap = nbytes + nbytes // 64 + chunk_bytes
    return (cap + PAGE - 1) // PAGE * PAGE


def meta_capacity(meta_len: int, nbytes: int) -> int:
    """Manifest bytes per slot: 4x the manifest, at least a quarter of the slot's
    ``nbytes`` of data, between ``SMALL_META`` and ``MIN_META``."""
    return (max(meta_floor(nbytes), 4 * meta_len) + PAGE - 1) // PAGE * PAGE


def meta_floor(nbytes: int) -> int:
    """The least manifest bytes of a slot of ``nbytes``: a quarter of it, in
    ``SMALL_META`` .. ``MIN_META``."""
    return min(MIN_META, max(SMALL_META, nbytes // 4))


def arena_slots(arena: Arena | None, num_slots: int, spare: bool) -> dict[str, int | None]:
    """stats() fields: the arena's slot count and bytes, and what the spare slot costs."""
    n = arena.num_slots if arena is not None else num_slots
    per_slot = (arena.total_bytes - 4096) // n if arena is not None else None
    return {"arena_slots": n, "arena_bytes": arena.total_bytes if arena is not None else None,
            "spare_slot_bytes": (per_slot if spare else 0) if per_slot is not None else None}
