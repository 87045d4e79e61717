"""Byte layout of the staging arena (mirrors csrc/staging.h) and a reference CRC32C.

Kept independent of the C++ code on purpose: the tests compute geometry and
checksums themselves and compare with what the engine reports.
"""
from __future__ import annotations

import struct

PAGE = 4096

# struct ArenaHeader
AH_MAGIC, AH_VERSION, AH_NUM_SLOTS, AH_STRIDE = 0, 8, 12, 16
AH_DATA_CAP, AH_META_CAP, AH_CHUNK, AH_MAX_CHUNKS, AH_TOTAL = 24, 32, 40, 48, 56
AH_OWNER, AH_CREATED, AH_JOB, AH_CRC = 64, 72, 80, 208
AH_SIZE = 216

# struct SlotHeader
SH_MAGIC, SH_VERSION, SH_STATE, SH_SEQ, SH_STEP = 0, 8, 12, 16, 24
SH_DATA_BYTES, SH_META_BYTES, SH_NUM_CHUNKS, SH_COMPLETE_NS, SH_WRITER = 32, 40, 48, 56, 64
SH_META_CRC, SH_TABLE_CRC, SH_HEADER_CRC = 72, 76, 80
SH_SIZE = 88

EMPTY, WRITING, COMPLETE = 0, 1, 2


def round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def max_chunks(data_capacity: int, chunk: int) -> int:
    return (data_capacity + chunk - 1) // chunk


def table_bytes(data_capacity: int, chunk: int) -> int:
    return round_up(max_chunks(data_capacity, chunk) * 4, PAGE)


def slot_stride(data_capacity: int, meta_capacity: int, chunk: int) -> int:
    return (PAGE + table_bytes(data_capacity, chunk) + round_up(meta_capacity, PAGE)
            + round_up(data_capacity, PAGE))


def required_bytes(slots: int, data_capacity: int, meta_capacity: int, chunk: int) -> int:
    return PAGE + slots * slot_stride(data_capacity, meta_capacity, chunk)


def slot_offset(slot: int, data_capacity: int, meta_capacity: int, chunk: int) -> int:
    return PAGE + slot * slot_stride(data_capacity, meta_capacity, chunk)


def table_offset(slot: int, data_capacity: int, meta_capacity: int, chunk: int) -> int:
    return slot_offset(slot, data_capacity, meta_capacity, chunk) + PAGE


def meta_offset(slot: int, data_capacity: int, meta_capacity: int, chunk: int) -> int:
    return table_offset(slot, data_capacity, meta_capacity, chunk) + table_bytes(data_capacity,
                                                                                 chunk)


def data_offset(slot: int, data_capacity: int, meta_capacity: int, chunk: int) -> int:
    return meta_offset(slot, data_capacity, meta_capacity, chunk) + round_up(meta_capacity, PAGE)


def u32(buf: bytes, off: int) -> int:
    return struct.unpack_from("<I", buf, off)[0]


def u64(buf: bytes, off: int) -> int:
    return struct.unpack_from("<Q", buf, off)[0]


def i64(buf: bytes, off: int) -> int:
    return struct.unpack_from("<q", buf, off)[0]


def flip_byte(path, offset: int, mask: int = 0x01) -> None:
    """XORs one byte of a file in place (works on a live MAP_SHARED arena too)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"{path} has no byte at {offset}"
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


_POLY = 0x82F63B78
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c_ref(data: bytes, crc: int = 0) -> int:
    """Bytewise CRC32C (Castagnoli, reflected), the textbook definition."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF
