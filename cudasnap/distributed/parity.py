"""XOR parity across nodes (``node_replica="xor:K"``): the pieces without a thread.

Instead of a full copy of each rank's newest snapshot on another node, the nodes form
groups of ``K`` (ordered by their lowest rank, as the ring of full copies; a last group of
one joins the one before it). Within a group the j-th ranks of its nodes form a **parity
set** of K members (SCR's XOR scheme): every member cuts the *image* of one snapshot
(:func:`image_prefix` then its data) into K-1 segments of ``seg`` bytes and sends one to
each other member; the member at position p holds

    P[p] = XOR over members q != p of segment ((p - q - 1) mod K) of q's image,

so each member holds parity for 1/(K-1) of an image, and every member's image is spread
over the others' parity. A lost member L is rebuilt from the K-1 survivors: segment
((p - L - 1) mod K) of L's image is P[p] XOR the matching segments of the other survivors'
images (:func:`rebuild`). All members encode the **same step**, and each keeps the slot of
that step leased until the next round completed everywhere (cudasnap.distributed.parity_rounds):
the survivors' own bytes are half of every rebuild.

A parity file (``SHM/cudasnap-<job>-x<set>-h<holder>-s<step>.xor``, 0600) is the parity
bytes then a JSON trailer (the set, the step, ``seg``, and each contributor's image length
and CRC32C of its prefix), its length and a magic: written under a hidden name and renamed
whole, so a name that exists is a complete file. Nothing is pickled.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._native import native
from ..errors import CorruptSnapshot
from .replica_store import fetch_path, make_arena
from .replica_wire import MAX_HEADER, WireError, check_geometry, land, slot_header

if TYPE_CHECKING:
    import socket
    import threading
    from collections.abc import Callable

    from cudasnap._C import Arena

    from .kv import KV
    from .local import LocalSnapshots

MAGIC = b"CSXOR001"
_ALIGN = 64


class Link(Protocol):
    """What a ParityKeeper needs of its Replicator (cudasnap.distributed.replica)."""

    kv: KV
    local: LocalSnapshots
    rate: float | None  # bytes/s cap of background sends (None: none)
    rank: int
    job: str
    shm: Path
    node: str

    @property
    def stopping(self) -> threading.Event:
        """Set when replication stops: every wait of a round ends."""

    def nodes(self, timeout: float = 0.0) -> dict[int, str] | None:
        """Every rank's node id, None until all published theirs."""

    def connect(self, rank: int) -> tuple[socket.socket, str]:
        """A connection to ``rank``'s replica server and the token its requests carry."""


def parity_sets(nodes: dict[int, str], k: int) -> list[list[int]]:
    """The parity sets of a job: ranks by node (``nodes``: rank -> node id), nodes in
    groups of ``k`` in the order of their lowest rank (a last group of one node joins
    the group before it), and within a group the j-th ranks of its nodes. ValueError
    when a group's nodes run different numbers of ranks."""
    order: list[str] = []
    for r in sorted(nodes):
        if nodes[r] not in order:
            order.append(nodes[r])
    if len(order) < 2:
        return []
    groups = [order[i:i + k] for i in range(0, len(order), k)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        last = groups.pop()
        groups[-1] += last
    out: list[list[int]] = []
    for g in groups:
        ranks = [sorted(r for r in nodes if nodes[r] == n) for n in g]
        if len({len(x) for x in ranks}) != 1:
            raise ValueError(f"nodes {g} run {[len(x) for x in ranks]} ranks: XOR parity "
                             "needs the same number of ranks on every node of a group")
        out += [[x[j] for x in ranks] for j in range(len(ranks[0]))]
    return out


def seg_index(holder: int, member: int, k: int) -> int:
    """Which of ``member``'s K-1 segments the member at position ``holder`` holds parity
    of (positions within the set; holder != member)."""
    return (holder - member - 1) % k


def seg_bytes(image_lengths: list[int], k: int) -> int:
    longest = max(image_lengths)
    per = -(-longest // (k - 1))
    return max(_ALIGN, -(-per // _ALIGN) * _ALIGN)


# ---------------------------------------------------------------- images
def image_prefix(arena: Arena, slot: int) -> bytes:
    """What precedes a slot's data in its image: a 4-byte length, the slot header (JSON),
    the slot meta and the CRC32C table (little-endian): every byte a rebuild needs to
    land the slot again, checked by the table (data) and the prefix CRC (the rest)."""
    hdr = slot_header(arena, slot)
    body = json.dumps(hdr, separators=(",", ":")).encode()
    table = arena.read_table(slot)
    return b"".join((struct.pack(">I", len(body)), body, arena.read_meta(slot),
                     struct.pack(f"<{len(table)}I", *table)))


class Image:
    """The image of a leased COMPLETE slot: its prefix then its data, zero beyond."""

    def __init__(self, arena: Arena, slot: int) -> None:
        self.prefix = image_prefix(arena, slot)
        n = int(arena.slot_info(slot)["data_bytes"])
        self.data = arena.data_view(slot, n) if n else memoryview(b"")
        self.length = len(self.prefix) + n

    def desc(self) -> dict[str, int]:
        return {"len": self.length, "plen": len(self.prefix),
                "pcrc": int(native().crc32c(self.prefix))}

    def pieces(self, off: int, n: int) -> list[memoryview]:
        """``n`` bytes from ``off`` as views (prefix, data; zeros past the end): sent
        without a copy."""
        out: list[memoryview] = []
        p = len(self.prefix)
        if off < p:
            out.append(memoryview(self.prefix)[off:min(off + n, p)])
        lo, hi = max(off, p), min(off + n, self.length)
        if lo < hi:
            out.append(self.data[lo - p:hi - p])
        pad = n - sum(len(v) for v in out)
        if pad:
            out.append(memoryview(bytes(pad)))
        return out

    def read(self, off: int, n: int) -> bytes:
        """``n`` bytes from ``off`` (zeros past the end)."""
        return b"".join(self.pieces(off, n))


def xor_into(acc: memoryview | bytearray | mmap.mmap, off: int, piece: bytes | memoryview) -> None:
    """acc[off:off+len(piece)] ^= piece."""
    a = np.frombuffer(acc, dtype=np.uint8, count=len(piece), offset=off)
    np.bitwise_xor(a, np.frombuffer(piece, dtype=np.uint8), out=a)


# ---------------------------------------------------------------- files
def parity_path(shm: Path, job: str, sid: int, holder: int, step: int) -> Path:
    return Path(shm) / f"cudasnap-{job}-x{sid}-h{holder}-s{step}.xor"


def parity_files(shm: Path, job: str) -> list[tuple[Path, int, int, int]]:
    """(path, set, holder, step) of every parity file of ``job`` in ``shm``."""
    pat = re.compile(rf"^cudasnap-{re.escape(job)}-x(\d+)-h(\d+)-s(\d+)\.xor$")
    out: list[tuple[Path, int, int, int]] = []
    try:
        names = sorted(os.listdir(shm))
    except OSError:
        return out
    for name in names:
        m = pat.match(name)
        if m:
            out.append((Path(shm) / name, int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return out


def drop_parity_newer(shm: Path, job: str, step: int) -> int:
    """After a restore to ``step`` (-1: nothing restored): the parity files of later
    steps encode the timeline before it and are removed. Returns how many."""
    n = 0
    for path, _sid, _holder, s in parity_files(shm, job):
        if s > step:
            path.unlink(missing_ok=True)
            n += 1
    return n


class Accumulator:
    """A parity file being made: ``seg`` zero bytes in a hidden file of shared memory,
    XORed into as contributions arrive, then :meth:`finish` (trailer, rename)."""

    def __init__(self, final: Path, seg: int) -> None:
        self.final, self.seg = final, seg
        self.tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # reserved now: a full tmpfs is an OSError here (the round aborts), never a
            # SIGBUS on a write through the mapping
            os.posix_fallocate(fd, 0, seg)
            self.map = mmap.mmap(fd, seg)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.got: dict[int, dict[str, int]] = {}  # contributor (src) -> its image desc
        self.dead = False  # dropped (the round ended without it): no more writes
        self.round: tuple[str, int, list[int]] | None = None  # (tag, step, members) it encodes

    def add(self, off: int, piece: bytes | memoryview) -> None:
        xor_into(self.map, off, piece)

    def finish(self, trailer: dict[str, Any]) -> Path:
        self.map.flush()
        self.map.close()
        body = json.dumps(trailer, separators=(",", ":")).encode()
        fd = os.open(self.tmp, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: dropped -> error
        try:
            os.write(fd, body + struct.pack(">I", len(body)) + MAGIC)
        finally:
            os.close(fd)
        os.replace(self.tmp, self.final)
        return self.final

    def drop(self) -> None:
        self.dead = True
        try:
            self.map.close()
        except (BufferError, ValueError):
            pass
        self.tmp.unlink(missing_ok=True)


def read_trailer(path: Path) -> dict[str, Any]:
    """A parity file's trailer (CorruptSnapshot when the file is not one)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size < 12:
                raise CorruptSnapshot(f"{path}: not a parity file ({size} bytes)")
            f.seek(size - 12)
            tail = f.read(12)
            (n,) = struct.unpack(">I", tail[:4])
            if tail[4:] != MAGIC or n > MAX_HEADER or n > size - 12:
                raise CorruptSnapshot(f"{path}: not a parity file (bad trailer)")
            f.seek(size - 12 - n)
            t = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise CorruptSnapshot(f"{path}: unreadable parity file: {e}") from None
    if not isinstance(t, dict) or int(t.get("seg", -1)) != size - 12 - n:
        raise CorruptSnapshot(f"{path}: parity trailer does not match its size")
    return t


def read_parity(path: Path, seg: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(seg)
    if len(data) != seg:
        raise CorruptSnapshot(f"{path}: parity file shorter than its {seg} bytes")
    return data


# ---------------------------------------------------------------- rebuild
def rebuild(lost: int, members: list[int], seg: int, length: int,
            parity_of: Callable[[int], bytes],
            segment_of: Callable[[int, int], bytes]) -> bytearray:
    """The image of member ``lost`` (``length`` bytes) from the survivors: ``parity_of(m)``
    is member m's parity (``seg`` bytes), ``segment_of(m, s)`` segment s of m's image."""
    k = len(members)
    pos = {m: i for i, m in enumerate(members)}
    out = bytearray((k - 1) * seg)
    for m in members:
        if m == lost:
            continue
        acc = bytearray(parity_of(m))
        if len(acc) != seg:
            raise WireError(f"member {m}'s parity is {len(acc)} bytes, not {seg}")
        for x in members:
            if x not in (m, lost):
                xor_into(acc, 0, segment_of(x, seg_index(pos[m], pos[x], k)))
        s = seg_index(pos[m], pos[lost], k)
        out[s * seg:(s + 1) * seg] = acc
    del out[length:]
    return out


class _Buffer:
    """land()'s source for bytes already here (a rebuilt image)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view, self.off = memoryview(data), 0

    def read_into(self, mv: memoryview) -> None:
        n = len(mv)
        if self.off + n > len(self.view):
            raise WireError("rebuilt image shorter than its header says")
        mv[:] = self.view[self.off:self.off + n]
        self.off += n


def land_image(image: bytearray, desc: dict[str, int], shm: Path, job: str, rank: int,
               threads: int) -> tuple[Arena, int, Path]:
    """A rebuilt image landed in a temporary arena of this node (as a fetched copy:
    checked chunk by chunk against its table; its prefix against ``desc``'s CRC32C)."""
    plen = int(desc["plen"])
    if len(image) < plen or native().crc32c(bytes(image[:plen])) != int(desc["pcrc"]):
        raise CorruptSnapshot("rebuilt image: its header, meta or table fails the CRC32C "
                              "taken when it was encoded")
    (n,) = struct.unpack(">I", image[:4])
    try:
        hdr = json.loads(bytes(image[4:4 + n]))
    except ValueError as e:
        raise CorruptSnapshot(f"rebuilt image: malformed header: {e}") from None
    _, m, k, _ = check_geometry(hdr)
    if plen != 4 + n + m + 4 * k:
        raise CorruptSnapshot(f"rebuilt image: its prefix is {plen} bytes, its header says "
                              f"{4 + n + m + 4 * k}")
    src = _Buffer(image)
    src.off = 4 + n
    path = fetch_path(shm, job, rank)
    try:
        arena = make_arena(path, hdr, job, exact=True)
        slot = land(src, hdr, arena, threads)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return arena, slot, path


def held_parity(shm: Path, job: str) -> list[dict[str, Any]]:
    """The trailers of every parity file of ``job`` this node holds (for the restore
    vote; an unreadable file is skipped)."""
    out = []
    for path, sid, holder, step in parity_files(shm, job):
        try:
            t = read_trailer(path)
        except CorruptSnapshot:
            continue
        if (int(t.get("sid", -1)), int(t.get("holder", -1)), int(t.get("step", -1))) == \
                (sid, holder, step):
            out.append({k: t.get(k) for k in ("sid", "step", "seg", "members", "holder",
                                              "images", "tag")})
    return out


def plans(entries: list[tuple[int, dict[str, Any]]],
          serving: dict[int, dict[int, list[int]]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Which (rank, step) images can be rebuilt, and from where: ``entries`` are
    (rank whose node holds it, trailer) of every parity file in the job; ``serving[src]
    [step]`` the ranks whose node holds ``src``'s slot of ``step``. A member is
    rebuildable at a step when every other member of its set has a parity file of that
    step and its slot of that step is held somewhere. Files count together only when they
    come from one round (its ``tag``: the store namespace and round) and agree on the lost
    member's image: files of another timeline (a step number run again after a restore)
    never mix."""
    by: dict[tuple[str, int, int, tuple[int, ...]], dict[int, tuple[int, dict[str, Any]]]] = {}
    for r, t in entries:
        try:
            key = (str(t["tag"]), int(t["sid"]), int(t["step"]), tuple(int(m) for m in t["members"]))
            by.setdefault(key, {}).setdefault(int(t["holder"]), (r, t))
        except (KeyError, TypeError, ValueError):
            continue
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for (_tag, sid, step, members), held in by.items():
        for lost in members:
            others = [m for m in members if m != lost]
            if not all(m in held for m in others):
                continue
            segs = {int(held[m][1]["seg"]) for m in others}
            descs = [held[m][1]["images"].get(str(lost)) for m in others]
            desc = descs[0] if all(d == descs[0] for d in descs) else None
            # every survivor's own image as the other holders recorded it (checked
            # against its slot when it is read)
            seen = {x: held[m][1]["images"].get(str(x)) for m in others for x in others
                    if x != m}
            dfrom: dict[int, int] = {}
            for m in others:
                rs = serving.get(m, {}).get(step, [])
                if rs:
                    dfrom[m] = m if m in rs else min(rs)
            if len(segs) != 1 or desc is None or len(dfrom) != len(others):
                continue
            if any(v is None for v in seen.values()):
                continue
            out[(lost, step)] = {"sid": sid, "step": step, "seg": segs.pop(),
                                 "members": list(members), "desc": desc, "descs": seen,
                                 "parity_from": {m: held[m][0] for m in others},
                                 "data_from": dfrom}
    return out
