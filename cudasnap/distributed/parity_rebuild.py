"""A lost rank rebuilt from its XOR parity set's survivors (cudasnap.distributed.parity).

The rebuilding rank asks each survivor m, over its replica server (``xget``), for m's parity
file of the step and for the segments of the other survivors' images XORed into it (each
survivor's slot refused unless its image is the one the encoding round recorded), XORs
them in memory, and lands the image through the CRC32C checks of a fetched copy."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .parity import Link, land_image, rebuild
from .replica_wire import WireError, recv_into, recv_msg, send_msg

if TYPE_CHECKING:
    from cudasnap._C import Arena


def _get(link: Link, rank: int, req: dict[str, Any], desc: dict[str, int] | None = None) -> bytes:
    """Bytes of a parity file or of an image (``desc``: what the encoding round recorded of
    that image; a slot that is not it is refused)."""
    sock, token = link.connect(rank)
    with sock:
        send_msg(sock, dict(req, op="xget", token=token, job=link.job, src=req.get("src", 0)))
        hdr = recv_msg(sock)
        if not hdr.get("ok"):
            raise WireError(f"rank {rank}: {hdr.get('error')}")
        if desc is not None and hdr.get("desc") != desc:
            raise WireError(f"rank {rank}'s slot of rank {req.get('src')} step "
                            f"{req.get('step')} is not the image the parity encodes")
        buf = bytearray(int(hdr["n"]))
        recv_into(sock, memoryview(buf))
    return bytes(buf)


def rebuild_rank(link: Link, rank: int, plan: dict[str, Any], threads: int
                 ) -> tuple[Arena, int, Path]:
    """``rank``'s image of ``plan["step"]`` (a plan of cudasnap.distributed.parity.plans), landed
    in a temporary arena of this node: (arena, slot, path); the caller removes it."""
    step, sid, seg = int(plan["step"]), int(plan["sid"]), int(plan["seg"])
    pfrom, dfrom = plan["parity_from"], plan["data_from"]

    def parity_of(m: int) -> bytes:
        return _get(link, pfrom[m], {"what": "parity", "sid": sid, "holder": m, "step": step})

    def segment_of(m: int, s: int) -> bytes:
        return _get(link, dfrom[m], {"what": "image", "src": m, "step": step, "off": s * seg,
                                     "n": seg}, plan["descs"].get(m))

    desc = plan["desc"]
    image = rebuild(rank, plan["members"], seg, int(desc["len"]), parity_of, segment_of)
    return land_image(image, desc, link.shm, link.job, rank, threads)
