"""What a storage writer reads of a leased arena slot: the same for every backend.

``complete_slot`` is the first call of every write (``posix.write_slot``,
``fsspec.FsspecStorage.write_slot``, ``remote_ranks.upload_rank``): a writer stores only a
COMPLETE slot, with the manifest the copy wrote.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import CorruptSnapshot
from ..format import manifest as fmt

if TYPE_CHECKING:  # type-only: importing this module loads neither torch nor _C
    from cudasnap._C import Arena, SlotInfo


def complete_slot(arena: Arena, slot: int) -> tuple[SlotInfo, dict[str, Any]]:
    """A leased slot's info and parsed manifest, for a writer: CorruptSnapshot when the slot
    is not COMPLETE or its CRC-consistent manifest is not a JSON object (refuse, never crash)."""
    info = arena.slot_info(slot)
    if not info["valid"]:
        raise CorruptSnapshot(f"slot {slot} of {arena.path} is not complete: {info['problem']}")
    return info, fmt.parse_slot_meta(arena.read_meta(slot), f"slot {slot} of {arena.path}")


__all__ = ["complete_slot"]
