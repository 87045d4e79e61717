"""``cudasnap inspect URL`` / ``cudasnap verify URL``: the rows and lines of an object store.

A multi-rank step is one row (its COMMIT's world size, rank 0's part) and is verified
part by part: every present rank's manifest and every chunk of its data.
Call order: ``tools.cli`` -> ``inspect_url`` / ``verify_url`` (the URL's backend from
``storage.registry``, unchecked for writing; an unreachable store becomes one line) ->
``inspect_rows`` / ``verify_lines``.
"""
from __future__ import annotations

import time
from typing import Any

from ..config import Settings
from ..errors import SnapshotError
from ..format.commit import MAX_COMMIT_BYTES, decode_commit
from ..format.paths import COMMIT
from . import remote_ranks
from .registry import backend_of
from .remote_base import RemoteSnapshot, RemoteStore, _Unreachable


def _parts(st: RemoteStore, ref: RemoteSnapshot) -> list[RemoteSnapshot]:
    """The refs to check of a committed step: itself, or each present rank's part."""
    k = ref.path.split("://", 1)[1]
    c = decode_commit(st._cat(f"{k}/{COMMIT}", MAX_COMMIT_BYTES, "commit marker"),
                      f"{ref.path}/{COMMIT}")
    if c["world_size"] <= 1:
        return [ref]
    have = remote_ranks.present_ranks(st, ref.step, int(c["world_size"]))
    return [RemoteSnapshot(ref.step, st._url(remote_ranks.rank_key(st, ref.step, r)))
            for r in have] or [ref]


def verify_ref(st: RemoteStore, ref: RemoteSnapshot, threads: int = 4) -> tuple[bool, str]:
    """(ok, message): manifest checks and every chunk's CRC of every part of ``ref``."""
    t0 = time.perf_counter()
    n = chunks = 0
    try:
        parts = _parts(st, ref)
        for p in parts:
            m = st.load_manifest(p)
            st.read_data(p, m, threads)
            n += int(m["data"]["bytes"])
            chunks += len(m["data"]["crc32c"])
    except SnapshotError as e:
        return False, str(e)
    dt = time.perf_counter() - t0
    ranks = f", {len(parts)} ranks" if len(parts) > 1 else ""
    return True, f"{n / 1e6:.1f} MB, {chunks} chunks{ranks}, {n / max(dt, 1e-9) / 1e9:.2f} GB/s"


def inspect_rows(st: RemoteStore, verify: bool) -> list[dict[str, Any]]:
    latest = st.read_latest()
    rows: list[dict[str, Any]] = []
    for s in st.list_snapshots():
        row: dict[str, Any] = {"step": s.step, "source": st.protocol[:6], "path": s.path,
                               "commit": "committed", "latest": s.path.endswith(f"/{latest}")}
        try:
            parts = _parts(st, s)
            m = st.load_manifest(parts[0])
            row.update({"bytes": m["data"]["bytes"], "tensors": len(m["tensors"]),
                        "rank": m.get("rank", 0), "world_size": m.get("world_size", 1),
                        "created": m.get("created_unix"), "status": "unverified"})
        except SnapshotError as e:
            row["status"] = f"bad: {e}"
        if verify and not row["status"].startswith("bad"):
            ok, msg = verify_ref(st, s)
            row["status"] = "ok" if ok else f"FAILED: {msg}"
        rows.append(row)
    return rows


def verify_lines(st: RemoteStore, step: int | None) -> tuple[int, list[str]]:
    url = st.url
    snaps = [s for s in st.list_snapshots() if step is None or s.step == step]
    if not snaps:
        return 2, [f"no snapshot{'' if step is None else f' of step {step}'} in {url}"]
    lines, bad = [], 0
    for s in snaps:
        ok, msg = verify_ref(st, s)
        bad += not ok
        lines.append(f"step {s.step}: {'ok' if ok else 'FAILED'} ({msg})")
    return (1 if bad else 0), lines


def _unchecked(url: str, settings: Settings) -> RemoteStore:
    """The object-store backend of ``url`` (a URL: never the local one), made without the
    checks for writing."""
    st: RemoteStore = backend_of(url)(url, settings)  # type: ignore[call-arg, assignment]
    return st


def inspect_url(url: str, settings: Settings, verify: bool = False) -> list[dict[str, Any]]:
    """``cudasnap inspect URL``: one row per committed snapshot."""
    with _Unreachable(url, "list"):
        return inspect_rows(_unchecked(url, settings), verify)


def verify_url(url: str, settings: Settings, step: int | None = None) -> tuple[int, list[str]]:
    """``cudasnap verify URL``: (exit code, report lines)."""
    with _Unreachable(url, "verify"):
        return verify_lines(_unchecked(url, settings), step)
