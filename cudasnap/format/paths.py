"""Every name of the snapshot layout, in one place: files, directories, arenas, job ids.

Layout of a snapshot directory ``DIR`` (local path or fsspec URL)::

    DIR/.lock                     owner pid/host of the job writing here (flock; POSIX only)
    DIR/.cudasnap-id              the directory's random identity (see below)
    DIR/latest                    text: name of the newest committed step directory
    DIR/flush-log.jsonl           one JSON line per flush
    DIR/step-00000041/            one committed snapshot
        manifest.json             JSON manifest (cudasnap.format.manifest)
        data.bin                  raw bytes, CRC32C per chunk listed in the manifest
        COMMIT                    multi-rank (and object-store) commit marker
        rank-00003/               one rank's manifest.json + data.bin (multi-rank)

Directory identity and job id. A staging arena in shared memory outlives its
process, so that a restarted job restores from it. It must be adopted only by
the SAME directory it was made for: after ``rm -rf ckpt`` (or a ``cudasnap run
--fresh``) a new run at the same path is a fresh start, not a resume from the
orphan arena. Each directory holds a random id (``.cudasnap-id``, 0600),
created once by the first process that needs it (atomically: ``link()`` of a
complete temporary file, so concurrent ranks agree). The job name is ``P + I``:
eight hex digits of the path's hash, eight of the id's. An arena of the same
path but another id belongs to a directory that is gone or was re-created: it
is not adopted, a warning names it, and ``cudasnap gc`` removes it once its
owner is dead. The arena of (job, rank) is ``SHM/cudasnap-<job>-r<rank>.arena``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("cudasnap.format.paths")

ID_FILE = ".cudasnap-id"
MANIFEST = "manifest.json"
DATA = "data.bin"
LATEST = "latest"
COMMIT = "COMMIT"
FLUSH_LOG = "flush-log.jsonl"
DIST_LOG = "dist-log.jsonl"  # the coordinator's events (cudasnap.distributed.events)
EVENT_LOG = "dist-log.jsonl"
STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dirname(step: int) -> str:
    """``step-00000041``: the directory (or object prefix) of one committed step."""
    return f"step-{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a committed step directory name; None for anything else."""
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def rank_dirname(rank: int) -> str:
    """``rank-00003``: one rank's files inside a multi-rank step directory."""
    return f"rank-{rank:05d}"


def arena_name(job: str, rank: int) -> str:
    """File name of the shared-memory staging arena of ``job``'s ``rank``."""
    return f"cudasnap-{job}-r{rank}.arena"


def arena_path(shm: Path | str, job: str, rank: int) -> Path:
    return Path(shm) / arena_name(job, rank)


def arena_glob(job: str | None = None) -> str:
    """Glob pattern of every rank's arena of ``job`` (every job's when None)."""
    return f"cudasnap-{job}-r*.arena" if job else "cudasnap-*.arena"


def is_url(directory: object) -> bool:
    """True for an fsspec URL (``s3://bucket/prefix``); a local path otherwise."""
    return isinstance(directory, str) and "://" in directory and not directory.startswith("file://")


def url_hash(url: str) -> str:
    return hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


def _path_hash(directory: Path) -> str:
    return hashlib.sha1(os.path.realpath(directory).encode()).hexdigest()[:8]


def directory_id(directory: Path, create: bool = True) -> str | None:
    """The directory's random id; created when missing (None if not and not ``create``)."""
    path = Path(directory) / ID_FILE
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        if not create:
            return None
    tmp = Path(directory) / f".{ID_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(16) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process won the race: read its id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def renew_id(directory: Path) -> str:
    """Gives the directory a new identity (``--fresh``): its old arenas are no longer adopted."""
    (Path(directory) / ID_FILE).unlink(missing_ok=True)
    new = directory_id(directory)
    assert new is not None
    return new


def _job(directory: Path, ident: str) -> str:
    return _path_hash(directory) + hashlib.sha1(ident.encode()).hexdigest()[:8]


def job_id(directory: str | Path) -> str:
    """The job id of the local snapshot directory ``directory`` (``P + I``, see above).

    Creates the directory's id when it has none. The one place the job id is
    derived: a Snapshotter, ``cudasnap run`` and the integrations all call it, so
    they agree on the arena name. An object-store URL has no id of its own: pass
    its local state directory (``cudasnap.storage.remote_base.state_dir``).
    """
    if is_url(directory):
        raise ConfigError(f"{directory} is an object-store URL: its job id is that of its local "
                          "state directory (storage.local_dir)")
    d = Path(directory)
    ident = directory_id(d)
    assert ident is not None
    return _job(d, ident)


def job_for(directory: Path, create: bool = True) -> str | None:
    """``job_id(directory)``; or, with ``create=False``, None when the directory has no id yet
    (a look-up that must not give it one: ``cudasnap status``, ``gc``)."""
    if create:
        return job_id(directory)
    ident = directory_id(directory, create=False)
    return None if ident is None else _job(Path(directory), ident)


def stale_arenas(directory: Path, job: str, shm: Path) -> list[Path]:
    """Arenas made for an earlier directory at this path (gone or re-created)."""
    prefix = _path_hash(directory)
    if not job.startswith(prefix):
        return []  # a job name given explicitly (CUDASNAP_JOB): no path relation
    return sorted(p for p in Path(shm).glob(arena_glob(f"{prefix}*"))
                  if not p.name.startswith(f"cudasnap-{job}-"))


def snapshotter_job(directory: Path, shm: Path) -> str:
    """The job of a Snapshotter writing to ``directory`` (logs arenas it will not adopt)."""
    job = job_id(directory)
    for p in stale_arenas(directory, job, shm):
        log.warning("not adopting staging arena %s: it was made for an earlier %s (removed or "
                    "re-created since); `cudasnap gc` removes it", p, directory)
    return job
