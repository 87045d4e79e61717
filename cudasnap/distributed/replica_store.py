"""Where replicas live on a node: guest arenas in its shared memory, and the copies it holds.

The guest copy of rank ``src`` of a job is ``SHM/cudasnap-<job>-g<src>.arena``: an arena
of two slots (the newest COMPLETE replica, and the one being received), written by the
slot protocol of csrc/staging.h (cudasnap.distributed.replica_wire.land), so a transfer cut at
any byte never shows a torn replica. A guest whose geometry no longer fits (the state
grew) is made anew under a hidden temporary name, filled, committed, then renamed over
the old one: the path always names a complete arena (0600, as every arena).

A node holds a copy of rank ``src`` when its shared memory has that rank's own arena
(``-r<src>``: ranks renumbered by an elastic restart) or a guest of it (``-g<src>``).

Nothing is left behind at a clean end (issue 35 item 5): each process, once its final step
is committed (``Replicator.stop(clean=True)``), removes the guests it received
(:meth:`GuestStore.close`) and sweeps the node's arenas of the job (:func:`sweep`): every one it
holds (guests it claimed at start, ``claim_guests``) or whose holder is gone (own arenas
of ranks an elastic restart renumbered away, guests of dead receivers, temporaries), but
never one a live process of the node holds (another rank's own arena, the guests it
receives; that process removes them at its own end). ``cudasnap gc`` removes the same ones
once their holder is gone (:func:`hidden_holder` names the holder of a temporary).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._native import native
from .._proc import pid_alive
from ..errors import SnapshotError
from .local import empty_newer
from .replica_wire import WireError, check_geometry, land

if TYPE_CHECKING:
    from cudasnap._C import Arena

log = logging.getLogger("cudasnap.distributed")

GUEST_SLOTS = 2


def guest_path(shm: Path, job: str, src: int) -> Path:
    return Path(shm) / f"cudasnap-{job}-g{src}.arena"


def fetch_path(shm: Path, job: str, rank: int) -> Path:
    """A copy fetched from another node for this rank's restore (removed after it)."""
    return Path(shm) / f".cudasnap-{job}-fetch-r{rank}-{os.getpid()}.arena"


def copy_paths(shm: Path, job: str) -> dict[int, list[Path]]:
    """Every arena of ``job`` in ``shm`` by the rank it holds: own ones first, then guests."""
    pat = re.compile(rf"^cudasnap-{re.escape(job)}-([rg])(\d+)\.arena$")
    out: dict[int, list[Path]] = {}
    try:
        names = sorted(os.listdir(shm))
    except OSError:
        return out
    for kind in ("r", "g"):
        for name in names:
            m = pat.match(name)
            if m and m.group(1) == kind:
                out.setdefault(int(m.group(2)), []).append(Path(shm) / name)
    return out


def hidden_holder(name: str, job: str | None = None) -> int | None:
    """The pid a temporary arena's name carries (a fetched copy, a guest being regrown, a
    parity file being made) of
    ``job`` (any job's when None); None for another name."""
    j = re.escape(job) if job is not None else ".+"
    m = re.match(rf"^\.cudasnap-{j}-(?:fetch-r\d+-(\d+)\.arena|g\d+\.arena\.tmp-(\d+)"
                 rf"|x\d+-h\d+-s\d+\.xor\.tmp-(\d+))$", name)
    return None if m is None else int(m.group(1) or m.group(2) or m.group(3))


def clean_leftovers(shm: Path, job: str, guests: bool = False) -> list[Path]:
    """Removes the temporary arenas (fetched copies, guests being regrown) of ``job`` that
    dead processes left in ``shm``; ``guests``: every guest copy too (a fresh start)."""
    gpat = re.compile(rf"^cudasnap-{re.escape(job)}-g\d+\.arena$")
    gone: list[Path] = []
    try:
        names = os.listdir(shm)
    except OSError:
        return gone
    for name in names:
        pid = hidden_holder(name, job)
        if (pid is not None and not pid_alive(pid)) or (guests and gpat.match(name)):
            (Path(shm) / name).unlink(missing_ok=True)
            gone.append(Path(shm) / name)
    return gone


def claim_guests(shm: Path, job: str) -> int:
    """This process becomes the recorded owner of the node's guest copies of ``job`` (their
    receiver may be dead: a restarted job must keep them from ``cudasnap gc``)."""
    n = 0
    for paths_ in copy_paths(shm, job).values():
        for p in paths_:
            if p.name.rsplit("-", 1)[-1].startswith("g"):
                a = open_copy(p)
                if a is not None:
                    a.claim_owner()
                    n += 1
    return n


def holder(path: Path) -> int | None:
    """The pid holding an arena (its last ``claim_owner``, else its maker); None when it
    cannot be read (gone, or being made right now)."""
    try:
        return int(native().Arena.open(str(path), False, False).owner_pid)
    except (SnapshotError, OSError):
        return None


def sweep(shm: Path, job: str, keep: Path | None = None) -> list[Path]:
    """A clean end of this process: removes the arenas of ``job`` in ``shm`` (own arenas of
    any rank, guests, temporaries) that this process holds or whose holder is gone; those
    a live process of the node holds stay, and so does ``keep`` (this rank's own arena:
    its Snapshotter removes it at close). Returns what was removed."""
    gone = clean_leftovers(shm, job)
    me = os.getpid()
    for ps in copy_paths(shm, job).values():
        for p in ps:
            if keep is not None and p == keep:
                continue
            pid = holder(p)
            if pid is not None and (pid == me or not pid_alive(pid)):
                p.unlink(missing_ok=True)
                gone.append(p)
    return gone


def open_copy(path: Path) -> Arena | None:
    try:
        return native().Arena.open(str(path), True, False)
    except SnapshotError as e:
        log.warning("replica: unreadable arena %s skipped: %s", path, e)
        return None


def valid_steps(arena: Arena) -> list[int]:
    return sorted({int(arena.slot_info(i)["step"]) for i in range(arena.num_slots)
                   if arena.slot_info(i)["valid"]}, reverse=True)


def held_steps(shm: Path, job: str, skip: Path | None) -> dict[int, list[int]]:
    """Steps of every rank's copies held in ``shm`` (``skip``: this rank's own arena)."""
    out: dict[int, list[int]] = {}
    for src, ps in copy_paths(shm, job).items():
        steps: set[int] = set()
        for p in ps:
            if skip is not None and p == skip:
                continue
            a = open_copy(p)
            if a is not None:
                steps.update(valid_steps(a))
        if steps:
            out[src] = sorted(steps, reverse=True)
    return out


def find_slot(shm: Path, job: str, src: int, step: int,
              skip: Path | None = None) -> tuple[Arena, int] | None:
    """An arena in ``shm`` (``skip`` aside) holding a valid slot of ``step`` for ``src``."""
    for p in copy_paths(shm, job).get(src, []):
        if skip is not None and p == skip:
            continue
        a = open_copy(p)
        if a is None:
            continue
        for i in range(a.num_slots):
            info = a.slot_info(i)
            if info["valid"] and int(info["step"]) == step:
                return a, i
    return None


def drop_newer(shm: Path, job: str, step: int, keep: set[Path]) -> int:
    """After a restore to ``step``: the slots newer than it in every copy of ``shm`` (guests,
    own arenas of an earlier rank numbering; ``keep``: the arenas of this node's ranks,
    which their Snapshotters own) are emptied. They come from the timeline before the
    restore: a later round or restore must never take one for the resumed run's step of
    the same number (on a GPU the re-run steps need not be the same bytes). Returns how
    many were emptied."""
    n = 0
    for paths_ in copy_paths(shm, job).values():
        for p in paths_:
            a = open_copy(p) if p not in keep else None
            n += empty_newer(a, step) if a is not None else 0
    return n


def make_arena(path: Path, hdr: dict[str, Any], job: str, exact: bool = False) -> Arena:
    """A new two-slot arena sized for ``hdr`` (``exact``: for its bytes only; else for the
    sender's capacities, so later, bigger snapshots of the same layout still fit)."""
    n, m, _, c = check_geometry(hdr)
    cap = n if exact else max(n, int(hdr.get("data_capacity", n)))
    mcap = m if exact else max(m, int(hdr.get("meta_capacity", m)))
    path.unlink(missing_ok=True)
    # A guest is pre-faulted once (its transfers then write mapped pages); a fetched copy
    # is written once and removed: its pages are mapped by that one write.
    return native().Arena.create(str(path), GUEST_SLOTS, max(cap, 1), max(mcap, 1), c, job,
                                 not exact)


class GuestStore:
    """This process's guest arenas (one per source rank it receives from)."""

    def __init__(self, shm: Path, job: str, threads: int = 2) -> None:
        self.shm, self.job, self.threads = Path(shm), job, threads
        self._arenas: dict[int, Arena] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False  # close(): a replica still landing removes itself

    def receive(self, sock: socket.socket, hdr: dict[str, Any], src: int) -> int:
        """Lands a replica of ``src`` (header already read); returns its step."""
        with self._lock:
            if self._closed:
                raise WireError("the job ended here: no more replicas")
            lk = self._locks.setdefault(src, threading.Lock())
        with lk:
            n, m, _, c = check_geometry(hdr)
            final = guest_path(self.shm, self.job, src)
            a = self._arenas.get(src)
            if a is None and final.exists():
                a = open_copy(final)
                if a is not None:
                    a.claim_owner()  # `cudasnap gc` sees the live holder
            if a is not None and (a.chunk_bytes != c or a.data_capacity < n
                                  or a.meta_capacity < m):
                a = None  # regrown: a new arena, renamed over the old one once complete
            if a is not None:
                land(sock, hdr, a, self.threads)
                return self._keep(src, a, int(hdr["step"]))
            tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            try:
                a = make_arena(tmp, hdr, self.job)
                a.claim_owner()
                land(sock, hdr, a, self.threads)
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return self._keep(src, a, int(hdr["step"]))

    def _keep(self, src: int, a: Arena, step: int) -> int:
        with self._lock:
            if not self._closed:
                self._arenas[src] = a
                return step
        guest_path(self.shm, self.job, src).unlink(missing_ok=True)  # landed after close()
        raise WireError("the job ended here: replica dropped")

    def close(self) -> list[Path]:
        """A clean end of the job: the guests this process received are removed (one still
        landing removes itself), and no more are taken. Returns the paths removed."""
        with self._lock:
            self._closed = True
            srcs = list(self._arenas)
            self._arenas.clear()
        gone = [guest_path(self.shm, self.job, src) for src in srcs]
        for p in gone:
            p.unlink(missing_ok=True)
        return gone
