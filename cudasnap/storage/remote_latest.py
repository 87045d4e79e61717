"""``latest`` of an object-store directory, moved by compare-and-swap where the store can;
the directory id shared by every host (:func:`share_id`, a create-only write).

``latest`` is a hint (restore lists committed steps; it never needs it), but like the
POSIX pointer (``storage.latest.replace_latest``) it must never move back: two writers
can finish out of order (``cudasnap run``'s flush of a dead attempt's step N ends after
the restarted attempt committed N+3; the committer of a multi-rank round and a late
single-rank flush).

S3 (``s3://``, ``s3a://``; s3fs passes the headers to PutObject): the pointer is read
as (ETag, then body: in that order, so a body newer than the ETag makes the write fail,
never succeed on a stale decision), compared, and written with ``If-Match: <ETag>``
(``If-None-Match: *`` when there is none yet). A write that loses the race (412
PreconditionFailed) reads again and decides again, up to :data:`TRIES` times.

Other fsspec stores (and an S3-compatible server that answers the conditional headers
with 501 NotImplemented): read, compare, write, unconditionally. A writer can then slip
in between the read and the write and the pointer can name an older step for a while;
restore is unaffected (it lists the committed steps), and the next commit moves it on.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..format.commit import decode_latest, encode_latest
from ..format.paths import ID_FILE, parse_step_dirname
from .safe_io import replace_private

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger("cudasnap.storage.fsspec")

TRIES = 8
#: protocols whose PutObject takes If-Match / If-None-Match (s3fs forwards them)
CONDITIONAL = frozenset({"s3", "s3a"})
_unsupported: set[str] = set()  # endpoints that refused a conditional write (logged once)


def error_code(e: BaseException) -> str | None:
    """The S3 error code of a backend error or of its cause (botocore ClientError)."""
    for err in (e, e.__cause__, e.__context__):
        resp = getattr(err, "response", None)
        if isinstance(resp, dict):
            code = resp.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def _read(fs: AbstractFileSystem, key: str) -> tuple[str | None, str | None, bool]:
    """(ETag, pointer, exists) of ``key``: the ETag first (see the module docstring)."""
    fs.invalidate_cache(key)
    try:
        etag = fs.info(key).get("ETag")
    except FileNotFoundError:
        return None, None, False
    try:
        body = decode_latest(fs.cat_file(key))
    except FileNotFoundError:
        return None, None, False
    except (OSError, ValueError):
        body = None  # a damaged pointer is replaced
    return (str(etag) if etag else None), body, True


def replace_latest(fs: AbstractFileSystem, protocol: str, key: str, name: str,
                   is_committed: Callable[[int], bool], timeout: float | None = None) -> bool:
    """Points ``key`` at step directory ``name`` unless it names a newer committed step.

    True when written; False when left alone (a newer committed step) or when
    :data:`TRIES` conditional writes in a row lost the race, or ``timeout`` passed
    before a retry (logged)."""
    new_step = parse_step_dirname(name)
    conditional = protocol.lower() in CONDITIONAL and protocol.lower() not in _unsupported
    deadline = None if timeout is None else time.monotonic() + timeout
    for _ in range(TRIES):
        etag, cur, exists = _read(fs, key)
        cur_step = parse_step_dirname(cur) if cur else None
        if cur_step is not None and new_step is not None and cur_step > new_step \
                and is_committed(cur_step):
            log.info("latest stays at %s (newer than %s, which was committed after it)", cur,
                     name)
            return False
        kw: dict[str, Any] = {}
        if conditional:
            kw = {"IfMatch": etag} if exists and etag else {"mode": "create"}
        try:
            fs.pipe_file(key, encode_latest(name), **kw)
            return True
        except Exception as e:  # noqa: BLE001 - botocore errors are not OSError
            code = error_code(e)
            if conditional and code in ("PreconditionFailed", "ConditionalRequestConflict"):
                if deadline is not None and time.monotonic() > deadline:
                    log.warning("%s: not pointed at %s: the flush's timeout (%.1f s) passed "
                                "while other writers moved it; the step is committed", key,
                                name, timeout)
                    return False
                continue  # another writer moved it: read again, decide again
            if conditional and code in ("NotImplemented", "InvalidArgument", "NotImplementedError"):
                _unsupported.add(protocol.lower())
                conditional = False
                log.info("%s: the store refused a conditional write (%s): `latest` is "
                         "replaced without compare-and-swap", key, code)
                continue
            raise
    log.warning("%s: %d conditional writes lost the race in a row; left as it is", key, TRIES)
    return False


def share_id(fs: AbstractFileSystem, protocol: str, key: str, local_dir: Path) -> str:
    """The directory id of a URL, the same on every host: ``ROOT/.cudasnap-id`` in the store.

    The id names the job, hence the arenas and the c10d keys of a multi-rank job; a URL's
    state directory is per host, so its local id would differ between the nodes of one job.
    The first start uploads the local id (or a new one) create-only (``If-None-Match: *``
    on S3; elsewhere a plain write, which a simultaneous first start on another host can
    overwrite: the ids then differ until the next start); every start copies the store's
    into the state directory, which ``format.paths.job_id`` reads."""
    local = local_dir / ID_FILE
    try:
        mine = local.read_text().strip() or None
    except OSError:
        mine = None
    try:
        theirs = bytes(fs.cat_file(key)).decode("ascii", errors="replace").strip() or None
    except FileNotFoundError:
        theirs = None
    if theirs is None:
        kw: dict[str, Any] = {"mode": "create"} if protocol.lower() in CONDITIONAL else {}
        try:
            fs.pipe_file(key, ((mine or secrets.token_hex(16)) + "\n").encode(), **kw)
        except Exception as e:  # noqa: BLE001 - botocore errors are not OSError
            if error_code(e) != "PreconditionFailed" and not isinstance(e, FileExistsError):
                raise
        theirs = bytes(fs.cat_file(key)).decode("ascii", errors="replace").strip()
    if theirs != mine:
        if mine is not None:
            log.info("%s: directory id %s taken from the store (was %s here)", key, theirs,
                     mine)
        replace_private(local, (theirs + "\n").encode())
    return theirs
