"""Reading a COMPLETE shared-memory slot straight through ``_C`` (CRC-checked)."""
from __future__ import annotations

import json
import warnings
from typing import Any

import torch


def read_slot(arena: Any, slot: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(slot info + ``meta_step``, name -> raw bytes as a uint8 tensor) of a COMPLETE slot;
    fails if the slot is not COMPLETE or a chunk fails its CRC32C."""
    from cudasnap import _C

    info = arena.slot_info(slot)
    assert info["valid"] and info["state"] == "COMPLETE", info
    n = int(info["data_bytes"])
    assert _C.verify_buffer(arena.data_ptr(slot), n, arena.chunk_bytes, arena.read_table(slot),
                            4) == -1, "a chunk of the slot fails its CRC32C"
    meta = json.loads(arena.read_meta(slot))
    with warnings.catch_warnings():  # a read-only arena gives a read-only buffer: we only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(arena.data_view(slot, n), dtype=torch.uint8) if n else None
    out = {}
    for e in meta["tensors"]:
        off, nb = int(e["offset"]), int(e["nbytes"])
        out[e["name"]] = data[off:off + nb].clone() if nb else torch.empty(0, dtype=torch.uint8)
    info["meta_step"] = meta.get("step")
    return info, out
