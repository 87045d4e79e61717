"""Wire format of node-loss replication (cudasnap.distributed.replica): raw bytes on a TCP stream.

One transfer per connection. A message is a header (4-byte big-endian length, then a JSON
object of at most :data:`MAX_HEADER` bytes); a snapshot follows its header as raw bytes:
its slot meta (``meta_bytes``), its CRC32C table (``num_chunks`` little-endian uint32) and
its data (``data_bytes``). Nothing is pickled. The receiver writes the bytes straight into a
WRITING slot of an arena (:func:`land`), checks every chunk against the table that came with
them, and only then commits the slot: a transfer cut at any byte leaves a WRITING slot,
which no reader trusts, and the arena's previous COMPLETE slot untouched.
"""
from __future__ import annotations

import ctypes
import json
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from .._native import native
from ..errors import CorruptSnapshot, SnapshotError, StagingError

if TYPE_CHECKING:
    from cudasnap._C import Arena

MAX_HEADER = 64 << 10
#: pieces of a data send or receive: each is one call with the GIL released (a training
#: thread holding the GIL makes every re-acquisition cost up to the switch interval)
PIECE = 64 << 20


def configure(sock: socket.socket, timeout_s: float) -> None:
    """Blocking I/O bounded by the kernel (SO_RCVTIMEO / SO_SNDTIMEO): a receive with
    MSG_WAITALL and a sendall then take one system call, and one GIL release, per piece."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class WireError(SnapshotError):
    """A transfer failed: the peer closed, timed out or answered with an error."""


def send_msg(sock: socket.socket, hdr: dict[str, Any]) -> None:
    body = json.dumps(hdr, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_HEADER:
        raise WireError(f"replica header of {len(body)} bytes exceeds {MAX_HEADER}")
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, mv: memoryview) -> None:
    got, n = 0, len(mv)
    while got < n:
        try:
            k = sock.recv_into(mv[got:], min(n - got, PIECE), socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO: no byte for that long
            raise WireError(f"peer silent after {got} of {n} bytes") from None
        if k == 0:
            raise WireError(f"peer closed the stream after {got} of {n} bytes")
        got += k


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise WireError(f"replica header of {n} bytes exceeds {MAX_HEADER}")
    try:
        hdr = json.loads(recv_exact(sock, n))
    except ValueError as e:
        raise WireError(f"malformed replica header: {e}") from None
    if not isinstance(hdr, dict):
        raise WireError("malformed replica header: not a JSON object")
    return hdr


class Throttle:
    """At most ``bytes_per_s`` (None: no cap), checked per piece."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._t0 = time.monotonic()
        self._sent = 0

    def pace(self, nbytes: int, stop: threading.Event | None) -> None:
        self._sent += nbytes
        if self.rate:
            ahead = self._sent / self.rate - (time.monotonic() - self._t0)
            if ahead > 0 and stop is not None and stop.wait(ahead):
                raise WireError("replication stopped")


def slot_header(arena: Arena, slot: int) -> dict[str, Any]:
    """The geometry fields of a COMPLETE slot's transfer header."""
    info = arena.slot_info(slot)
    return {"step": int(info["step"]), "seq": int(info["seq"]),
            "data_bytes": int(info["data_bytes"]), "meta_bytes": int(info["meta_bytes"]),
            "num_chunks": int(info["num_chunks"]), "chunk_bytes": int(arena.chunk_bytes),
            "data_capacity": int(arena.data_capacity), "meta_capacity": int(arena.meta_capacity)}


def send_slot(sock: socket.socket, arena: Arena, slot: int, hdr: dict[str, Any],
              throttle: Throttle | None = None, stop: threading.Event | None = None,
              yield_to_flush: bool = True) -> int:
    """Sends ``hdr`` then the slot's meta, table and data (the caller holds a lease on
    the slot). Yields while a flush of this process writes (``_C.flush_active()``)."""
    C = native()
    meta = arena.read_meta(slot)
    table = arena.read_table(slot)
    n = int(hdr["data_bytes"])
    if len(meta) != hdr["meta_bytes"] or len(table) != hdr["num_chunks"]:
        raise WireError("slot changed while it was being sent")
    body = json.dumps(hdr, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_HEADER:
        raise WireError(f"replica header of {len(body)} bytes exceeds {MAX_HEADER}")
    sock.sendall(b"".join((struct.pack(">I", len(body)), body, meta,
                           struct.pack(f"<{len(table)}I", *table))))
    view = arena.data_view(slot, n) if n else memoryview(b"")
    piece = PIECE if throttle is None or not throttle.rate else \
        int(min(PIECE, max(4 << 10, throttle.rate / 20)))  # a capped rate: ~50 ms pieces
    off = 0
    while off < n:
        while yield_to_flush and C.flush_active() > 0:  # the flush's disk writes come first
            if stop is not None and stop.wait(0.005):
                raise WireError("replication stopped")
        k = min(piece, n - off)
        sock.sendall(view[off:off + k])
        off += k
        if throttle is not None:
            throttle.pace(k, stop)
        if stop is not None and stop.is_set():
            raise WireError("replication stopped")
    return n


def check_geometry(hdr: dict[str, Any]) -> tuple[int, int, int, int]:
    """(data_bytes, meta_bytes, num_chunks, chunk_bytes) of a header, checked for sense."""
    try:
        n, m, k, c = (int(hdr[f]) for f in ("data_bytes", "meta_bytes", "num_chunks",
                                              "chunk_bytes"))
        int(hdr["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"replica header lacks a field or has a bad one: {e}") from None
    if min(n, m, k) < 0 or c <= 0 or k != (n + c - 1) // c:
        raise WireError(f"replica header geometry is inconsistent: {n} data bytes, "
                        f"{k} chunks of {c}")
    return n, m, k, c


class Source(Protocol):
    """Bytes already here for :func:`land` (a rebuilt parity image), not a socket."""

    def read_into(self, mv: memoryview) -> None: ...


def _read_into(src: socket.socket | Source, mv: memoryview) -> None:
    if isinstance(src, socket.socket):
        recv_into(src, mv)
    else:
        src.read_into(mv)


def _read(src: socket.socket | Source, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(src, memoryview(buf))
    return bytes(buf)


def land(sock: socket.socket | Source, hdr: dict[str, Any], arena: Arena, threads: int = 2) -> int:
    """Receives a snapshot into a free slot of ``arena``; returns the COMPLETE slot.

    The slot is WRITING from the first byte on and becomes COMPLETE only after every
    chunk matched the CRC32C table that came with it (CorruptSnapshot otherwise)."""
    n, m, k, c = check_geometry(hdr)
    if c != arena.chunk_bytes or n > arena.data_capacity or m > arena.meta_capacity \
            or k > arena.max_chunks:
        raise StagingError(f"{arena.path}: a snapshot of {n} bytes / {m} meta bytes / chunks "
                           f"of {c} does not fit this arena")
    meta = _read(sock, m)
    table = _read(sock, 4 * k)
    slot = arena.pick_write_slot()
    if slot < 0:
        raise StagingError(f"{arena.path}: no free slot for a replica")
    step = int(hdr["step"])
    arena.begin_write(slot, step, meta)
    try:
        if n:
            _read_into(sock, arena.data_view(slot, n))
        if k:
            ctypes.memmove(arena.table_ptr(slot), table, len(table))
        crcs = list(struct.unpack(f"<{k}I", table))
        bad = native().verify_buffer(arena.data_ptr(slot), n, c, crcs, threads) if n else -1
        if bad >= 0:
            raise CorruptSnapshot(f"{arena.path}: replica of step {step}: chunk {bad} fails "
                                  "its CRC32C on arrival")
        arena.commit(slot, step, n)
    except BaseException:
        arena.invalidate(slot)
        raise
    return slot
