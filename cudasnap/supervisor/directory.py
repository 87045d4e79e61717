"""The snapshot directory as ``cudasnap run`` holds it, before and between attempts.

Owns: where the supervisor keeps its state (:func:`open_directory`: the directory itself,
or for an object-store URL its local state directory; :func:`_refuse_url` refuses a URL a
``Path`` collapsed); one supervisor per directory
(:class:`SupervisorLock`, flock on DIR/.supervisor-lock for the whole run); the check that
no other job holds the directory's lock, waiting for a dead child's workers or for the
orphaned training process of a dead supervisor (:func:`_check_not_in_use`); where a run
would resume from (:func:`_resume_point`, :func:`_damaged`); ``--fresh``
(:func:`start_over`).

Call order (cudasnap.supervisor.loop.supervise): ``open_directory`` -> ``SupervisorLock.acquire``
-> ``_check_not_in_use`` -> ``start_over`` (``--fresh``) or ``_resume_point`` (logged); then
after each death ``_check_not_in_use(directory, child.pid)`` before the flush and the
restart; ``SupervisorLock.release`` at the end.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .._native import native
from .._proc import environ_of, ppid_of
from ..config import Settings
from ..errors import ConfigError, SnapshotError
from ..format import paths
from ..storage import listing, open_storage, ownership, posix
from ..storage.ownership import check_directory

if TYPE_CHECKING:
    from ..storage.protocol import Storage

log = logging.getLogger("cudasnap.run")

_OBJECT_STORE = re.compile(r"^(s3a?|gs|gcs|az|abfss?|adl|oss|r2|hf|https?|memory):/", re.I)


def _refuse_url(directory: Path | str) -> None:
    """ConfigError for an object-store URL a Path has collapsed (``s3:/b/p``): it would
    make a local ``./s3:`` folder and flush nothing to the store."""
    text = str(directory)
    if not paths.is_url(text) and _OBJECT_STORE.match(text):
        raise ConfigError(
            f"--dir {text}: looks like an object-store URL whose '//' was lost (a Path "
            "collapses s3://b/p to s3:/b/p); object stores are given as a string URL: "
            "supervise(cmd, 's3://bucket/prefix')")


def open_directory(directory: Path | str, settings: Settings) -> tuple[Path, Storage | None]:
    """(local directory of the supervisor's state, the object store or None).

    A file-system directory is both (None). An object-store URL (``s3://bucket/prefix``, any
    fsspec URL) is checked now (the bucket exists, the prefix is writable); the
    supervisor's lock, the directory id (hence the job and its arena names) and the
    training process's directory lock then live in the URL's local state directory,
    ``$CUDASNAP_STATE_DIR/url-<hash>`` (default ``~/.cache/cudasnap/url-<hash>``): the
    same one the training process's Snapshotter uses for that URL, so both name the same
    arenas and exclude the same jobs (one host; one job per URL across hosts)."""
    _refuse_url(directory)
    if paths.is_url(directory):
        storage = open_storage(str(directory), settings)  # its scheme's (storage.registry)
        return storage.local_dir, storage
    return check_directory(Path(directory)), None


class SupervisorLock:
    """One ``cudasnap run`` per directory: flock on DIR/.supervisor-lock for the whole run."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / ".supervisor-lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(f"snapshot directory {self.path.parent} is in use by another job "
                              f"(cudasnap run {owner}); use another directory or stop that "
                              "job") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _check_not_in_use(directory: Path, dead_child: int | None = None) -> None:
    """Raises ConfigError when another job holds the directory.

    A holder that names ``dead_child`` is ours: a process it forked (a data-loader
    worker) still has the lock's file open for a moment after the child died.
    """
    lock = ownership.DirectoryLock(directory)
    try:
        lock.acquire()
    except ConfigError:
        try:
            owner = (Path(directory) / ".lock").read_text().split()
        except OSError:
            owner = []
        if dead_child is not None and f"pid={dead_child}" in owner:
            if not _wait_released(lock.path, _WORKER_GRACE_S):
                log.warning("%s is still held by a process the dead training process started, "
                            "after %.0f s; restarting anyway", lock.path, _WORKER_GRACE_S)
            return
        holder = next((int(w[4:]) for w in owner if re.fullmatch(r"pid=\d+", w)), None)
        sup = _orphaned_by(holder) if holder is not None else None
        if sup is None:
            raise
        log.warning("snapshot directory %s is held by pid %d, the training process of a "
                    "cudasnap run (pid %d) that died; waiting up to %.0f s for it to stop "
                    "(it was sent SIGTERM: it flushes, then exits)", directory, holder, sup,
                    _ORPHAN_GRACE_S)
        if not _wait_released(lock.path, _ORPHAN_GRACE_S):
            raise ConfigError(f"snapshot directory {directory} is still held by pid {holder}, "
                              f"left running by a cudasnap run (pid {sup}) that died; stop it "
                              f"(kill {holder}) or use another directory") from None
        log.warning("pid %d released %s: starting", holder, directory)
        lock.acquire()  # (raises if a third job took it meanwhile)
    lock.release()


_WORKER_GRACE_S = 30.0
_ORPHAN_GRACE_S = 120.0


def _orphaned_by(pid: int) -> int | None:
    """The pid of the dead ``cudasnap run`` whose training process ``pid`` is, or None.

    Every attempt is started with CUDASNAP_SUPERVISOR_PID; one whose parent is no longer
    that supervisor was orphaned (the kernel sends it SIGTERM: PR_SET_PDEATHSIG).
    """
    env = environ_of(pid)
    try:
        sup = int(env.get("CUDASNAP_SUPERVISOR_PID", ""))
    except ValueError:
        return None
    parent = ppid_of(pid)
    if parent is None or parent == sup:
        return None
    return sup


def _wait_released(path: Path, timeout: float) -> bool:
    """Waits (blocking flock in a helper thread, no polling) for the processes still
    holding the directory lock (a dead child's workers, an orphan of a dead supervisor)
    to close it; True once released, False after ``timeout`` seconds."""
    released = threading.Event()
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def take_and_drop() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            released.set()

    threading.Thread(target=take_and_drop, name="cudasnap-lock-wait", daemon=True).start()
    return released.wait(timeout)


def _resume_point(directory: Path, job: str, shm: Path,
                  remote: Storage | None = None) -> str | None:
    """Where a run would resume from: "step N (source)", or None for a fresh start.
    ``remote``: the object store whose state directory ``directory`` is (its newest
    committed step is named unchecked: no data is read here)."""
    best: tuple[int, str] | None = None
    arenas = sorted(shm.glob(paths.arena_glob(job)))
    if arenas:
        C = native()
        for p in arenas:
            try:
                a = C.Arena.open(str(p), False)
                slot = a.newest_complete()
                if slot >= 0:
                    step = int(a.slot_info(slot)["step"])
                    if best is None or step > best[0]:
                        best = (step, f"shared memory {p}")
            except SnapshotError:
                continue
    if remote is not None:
        snaps = remote.list_snapshots()
        if snaps and (best is None or snaps[0].step > best[0]):
            best = (snaps[0].step, str(snaps[0].path))
        return None if best is None else f"step {best[0]} ({best[1]})"
    for s in posix.list_snapshots(directory):
        if best is not None and s.step <= best[0]:
            break
        problem = _damaged(s.path)
        if problem is None:
            best = (s.step, str(s.path))
            break
        log.warning("step %d in %s is damaged (%s): not a resume point", s.step, directory,
                    problem)
    return None if best is None else f"step {best[0]} ({best[1]})"


def _damaged(step_dir: Path) -> str | None:
    """What the supervisor checks of a snapshot on disk before naming it (cheap: no data
    is read): each manifest present parses and passes its own CRC, its data file has the
    manifest's size, a multi-rank step is committed. None when nothing is wrong. The
    data's checksums are verified by the training process when it restores."""
    subs = sorted(p for p in step_dir.glob("rank-*") if p.is_dir() and "." not in p.name)
    if subs and not listing.is_committed(step_dir):
        return "not committed"
    for d in subs or [step_dir]:
        if not (d / paths.MANIFEST).exists():
            continue  # nothing to check here: the restore decides
        try:
            m = posix.load_manifest(d / paths.MANIFEST)
            data = d / m["data"]["file"]
            size = data.stat().st_size
        except (SnapshotError, OSError, KeyError, TypeError) as e:
            return str(e)
        if size != int(m["data"]["bytes"]):
            return f"{data} is {size} bytes, its manifest says {m['data']['bytes']}"
    return None


def start_over(directory: Path) -> Path | None:
    """``--fresh``: moves the snapshots aside (as ``fresh=True`` does) and renews the
    directory's identity, so this job's old arenas are not adopted (``gc`` removes them)."""
    from ..storage.fresh import move_aside

    aside = move_aside(directory, None, threads=1)
    paths.renew_id(directory)
    return aside
