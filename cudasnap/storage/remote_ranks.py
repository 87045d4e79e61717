"""Multi-rank snapshots in an object store: rank parts, the commit, writers in progress, the index.

Layout under the URL ``ROOT`` (the names of a multi-rank POSIX directory)::

    ROOT/step-00000041/rank-00000/data.bin, manifest.json    each rank's part
    ROOT/step-00000041/rank-00001/...
    ROOT/step-00000041/COMMIT       last, by one rank, once every rank's part is there
    ROOT/step-00000041/rank-00001/.writer-<host>-<pid>       while that part is uploaded

Protocol (``cudasnap.distributed.flush_round`` drives it through ``RankParts``, the
rank-aware part of ``storage.protocol.Storage`` that ``FsspecStorage`` takes from here): the ranks
agree on a step through the c10d store, each uploads its part (data, then manifest; a
rank that finds the step committed with other content deletes its ``COMMIT`` first, so
the step is invisible until the round commits it again), the lowest live rank waits for
every rank's ``done`` marker and writes ``COMMIT`` (one PUT), then ``latest`` by
compare-and-swap (``storage.remote_latest``). A rank dying mid-upload never sets its
marker: the round fails and nothing is committed; its part stays invisible and is
removed by a later start.

Writers in progress. An object store has no rename and no flock, so a writer puts an
empty ``.writer-<host>-<pid>`` object beside its part before the first byte and removes
it when the part is complete. ``clean_partial`` (every Snapshotter start) leaves an
uncommitted step alone while such a marker names a live process on this host, or one
on another host younger than :data:`GRACE_S`: ``cudasnap run``'s flush of a dead attempt
runs while the restarted attempt starts, and the ranks of a job start at different times.

The local index (``sync_index``). The agreed restore (``cudasnap.distributed.restore_vote``)
lists the steps of the rank's local directory; for a URL that is the state directory
(``remote_base.state_dir``), where the index holds, per committed multi-rank step,
``step-N/COMMIT`` (a copy of the store's) and an empty ``step-N/rank-R/manifest.json``
per rank present. Every read goes to the store (``FsspecStorage.load_manifest`` maps an
index path to its objects and reads the store's COMMIT first): the index says what to
try, never what to load. It is rebuilt at every start of a multi-rank job
(``clean_partial``, see ``index_wanted``) and after every committed round on every rank;
one listing and one GET per committed step.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._points import reach as kill_point  # test fault points (cudasnap._testing)
from .._proc import pid_alive
from ..errors import CorruptSnapshot
from ..format import manifest as fmt
from ..format.commit import decode_commit, encode_commit
from ..format.paths import COMMIT, MANIFEST, parse_step_dirname, rank_dirname, step_dirname
from .safe_io import replace_private
from .slots import complete_slot

if TYPE_CHECKING:
    from cudasnap._C import Arena

    from .remote_base import RemoteStore

log = logging.getLogger("cudasnap.storage.fsspec")

WRITER = ".writer-"
#: a marker of a writer on another host is trusted this long (its liveness is unknown)
GRACE_S = 3600.0
RANK_RE = re.compile(r"^rank-(\d{5,})$")


# ---------------------------------------------------------------- writers in progress
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def mark_writer(st: RemoteStore, prefix: str) -> str:
    """Puts ``prefix/.writer-<host>-<pid>``; returns its key."""
    key = f"{prefix}/{WRITER}{_host()}-{os.getpid()}"
    st.fs.pipe_file(key, b"")
    return key


def unmark_writer(st: RemoteStore, key: str) -> None:
    try:
        st.fs.rm_file(key)
    except Exception as e:  # noqa: BLE001 - a leftover marker only delays a clean-up
        log.info("could not remove the writer marker %s: %s", key, e)


def _modified(info: dict[str, Any]) -> float | None:
    for k in ("LastModified", "mtime", "created", "last_modified"):
        v = info.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, int | float):
            return float(v)
    return None


def writer_in_progress(st: RemoteStore, step_key: str) -> str | None:
    """The marker of a writer still (possibly) at work under ``step_key``, else None."""
    try:
        found = st.fs.find(step_key, detail=True)
    except FileNotFoundError:
        return None
    for key, info in found.items():
        name = str(key).rsplit("/", 1)[-1]
        if not name.startswith(WRITER):
            continue
        host, _, pid = name[len(WRITER):].rpartition("-")
        if host == _host():
            if pid.isdigit() and pid_alive(int(pid)):
                return str(key)
            continue
        when = _modified(info)
        if when is not None and time.time() - when < GRACE_S:
            return str(key)
    return None


# ---------------------------------------------------------------- one rank's part
def rank_key(st: RemoteStore, step: int, rank: int) -> str:
    return st._key(step_dirname(step), rank_dirname(rank))


def upload_rank(st: RemoteStore, arena: Arena, slot: int, rank: int, *, threads: int = 4,
                extra_manifest: dict[str, Any] | None = None) -> str:
    """Uploads ``rank``'s part of a leased COMPLETE slot (data, then manifest); its URL.

    Never commits: the round's committer does, once every part is there."""
    info, meta = complete_slot(arena, slot)
    step, nbytes, chunk = int(info["step"]), int(info["data_bytes"]), int(arena.chunk_bytes)
    step_key = st._key(step_dirname(step))
    key = rank_key(st, step, rank)
    if st._committed_same(step_key, key, meta.get("job"), int(info["seq"])):
        log.info("rank %d: step %d already stored at %s", rank, step, st._url(key))
        return st._url(key)
    crcs = [int(c) for c in arena.read_table(slot)]
    bad = native().verify_buffer(arena.data_ptr(slot), nbytes, chunk, crcs, threads) \
        if nbytes else -1
    if bad >= 0:  # never upload bytes that do not match their checksums
        raise CorruptSnapshot(f"slot {slot} of {arena.path}: chunk {bad} fails its CRC32C")
    with st._failing(f"flush of rank {rank}'s part of step {step} to {st._url(key)}"):
        if st.fs.exists(f"{step_key}/{COMMIT}"):  # another run's copy: invisible first
            log.warning("step %d at %s is committed with other content: uncommitting it "
                        "until this round commits", step, st._url(step_key))
            st.fs.rm_file(f"{step_key}/{COMMIT}")
        marker = mark_writer(st, key)
        st._upload_data(key, arena, slot, nbytes)
        st.fs.pipe_file(f"{key}/{MANIFEST}",
                        fmt.stored_manifest(meta, info, chunk, crcs, extra_manifest))
        kill_point("manifest")
        unmark_writer(st, marker)
    log.info("rank %d: uploaded step %d (%.1f MB) to %s", rank, step, nbytes / 1e6, st._url(key))
    return st._url(key)


def clear_stale(st: RemoteStore, step: int, rank: int) -> None:
    """``rank``'s part of an uncommitted ``step`` is from a failed round: removed."""
    step_key, key = st._key(step_dirname(step)), rank_key(st, step, rank)
    if st.fs.exists(f"{step_key}/{COMMIT}"):
        return
    try:
        names = st.fs.ls(key, detail=False, refresh=True)
    except FileNotFoundError:
        return
    if names:
        log.warning("removing %s: left by a round that did not commit", st._url(key))
        st.fs.rm(key, recursive=True)


def present_ranks(st: RemoteStore, step: int, world: int) -> list[int]:
    """Ranks whose part of ``step`` is complete (its manifest exists): one listing."""
    step_key = st._key(step_dirname(step))
    st.fs.invalidate_cache()
    try:
        found = st.fs.find(step_key)
    except FileNotFoundError:
        return []
    have = {str(k) for k in found}
    return [r for r in range(world) if f"{rank_key(st, step, r)}/{MANIFEST}" in have]


def write_commit(st: RemoteStore, step: int, record: dict[str, Any]) -> None:
    """The step's ``COMMIT`` (one PUT: it exists whole or not at all)."""
    st.fs.pipe_file(st._key(step_dirname(step), COMMIT), encode_commit(record))
    kill_point("commit")


def committed_with(st: RemoteStore, step: int, rank: int) -> bool:
    step_key = st._key(step_dirname(step))
    st.fs.invalidate_cache()
    return bool(st.fs.exists(f"{step_key}/{COMMIT}")
                and st.fs.exists(f"{rank_key(st, step, rank)}/{MANIFEST}"))


# ---------------------------------------------------------------- the local index
def index_wanted(st: RemoteStore) -> bool:
    """Whether a start keeps the index: a multi-rank job now (torch.distributed already
    initialised with more than one rank, or WORLD_SIZE > 1), or an index already there (its
    stale entries go). A single-rank job skips the GET per committed step."""
    d = sys.modules.get("torch.distributed")
    try:
        if d is not None and d.is_available() and d.is_initialized() and d.get_world_size() > 1:
            return True
    except Exception:  # noqa: BLE001 - a half-initialised group: decide by the rest
        pass
    return st.settings.world_size > 1 or any(st.local_dir.glob("step-*"))


def sync_index(st: RemoteStore) -> None:
    """Rebuilds the local index of committed multi-rank steps (see the module docstring)."""
    committed: dict[int, bytes] = {}
    for step, key in st._step_dirs().items():
        try:
            raw = bytes(st.fs.cat_file(f"{key}/{COMMIT}"))
            rec = decode_commit(raw, st._url(f"{key}/{COMMIT}"))
        except (FileNotFoundError, CorruptSnapshot):
            continue
        if rec["world_size"] > 1 and rec["step"] == step:
            committed[step] = raw
    local = st.local_dir
    for p in local.glob("step-*"):
        old = parse_step_dirname(p.name)
        if old is not None and old not in committed and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
    for step, raw in committed.items():
        rec = json.loads(raw)
        d = local / step_dirname(step)
        d.mkdir(mode=0o700, exist_ok=True)
        present = {int(r) for r in rec.get("present", []) if isinstance(r, int)}
        for sub in d.iterdir():
            m = RANK_RE.match(sub.name)
            if m and int(m.group(1)) not in present:
                shutil.rmtree(sub, ignore_errors=True)
        for r in sorted(present):
            rd = d / rank_dirname(r)
            rd.mkdir(mode=0o700, exist_ok=True)
            if not (rd / MANIFEST).is_file():
                replace_private(rd / MANIFEST, b"")
        try:
            same = (d / COMMIT).read_bytes() == raw
        except OSError:
            same = False
        if not same:
            replace_private(d / COMMIT, raw)


class RankParts:
    """The rank-aware half of ``storage.protocol.Storage`` for ``fsspec.FsspecStorage``
    (a mixin: its methods run on the storage, over this module's functions). A rank's
    part is also named in the local index (``local_dir``), whose steps the agreed
    restore lists."""

    def clear_stale(self: RemoteStore, step: int, rank: int) -> None:
        with self._failing(f"clean-up of rank {rank}'s part of step {step}"):
            clear_stale(self, step, rank)

    def write_rank(self: RemoteStore, arena: Arena, slot: int, rank: int, *, threads: int,
                   extra_manifest: dict[str, Any]) -> Path:
        upload_rank(self, arena, slot, rank, threads=threads, extra_manifest=extra_manifest)
        step = int(arena.slot_info(slot)["step"])
        return self.local_dir / step_dirname(step) / rank_dirname(rank)

    def present(self: RemoteStore, step: int, world: int) -> list[int]:
        return present_ranks(self, step, world)

    def commit(self: RemoteStore, step: int, record: dict[str, Any], keep: int,
               timeout: float | None = None) -> None:
        with self._failing(f"commit of step {step} to {self.url}"):
            write_commit(self, step, record)
        try:
            self.replace_latest(step, timeout)
            self.prune(keep)
            sync_index(self)
        except Exception as e:  # noqa: BLE001 - committed: `latest` and the index are hints
            log.warning("step %d is committed at %s, but updating latest/pruning failed: %s",
                        step, self.url, e)

    def committed_with(self: RemoteStore, step: int, rank: int) -> bool:
        return committed_with(self, step, rank)

    def refresh(self: RemoteStore) -> None:
        try:
            sync_index(self)
        except Exception as e:  # noqa: BLE001 - the index is rebuilt at the next start
            log.warning("could not refresh the local index of %s: %s", self.url, e)
