"""Leftovers of interrupted flushes in a POSIX snapshot directory (``clean_partial``).

A flush writes ``step-N.tmp-<pid>`` (or ``step-N/rank-R.tmp-<pid>``), moves a replaced
committed copy to ``.old-<pid>`` and writes ``.latest.tmp-<pid>``; a process killed
half-way leaves them. The next Snapshotter removes them at construction, except while
their writer is still running on this host (``cudasnap run`` flushes the dead attempt's
arena while the restarted attempt starts).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from .._proc import pid_alive, process_start_time
from ..format.paths import LATEST

log = logging.getLogger("cudasnap.storage.partial")


def _writer_alive(p: Path) -> bool:
    """True when the ``.tmp-<pid>`` / ``.old-<pid>`` entry ``p`` belongs to another live
    process of this host: a flush in progress (e.g. ``cudasnap run``'s flush of the dead
    attempt's arena while the restarted attempt starts), never to be removed under it."""
    m = re.search(r"\.(?:tmp|old)-(\d+)", p.name)
    if m is None:
        return False
    pid = int(m.group(1))
    if pid == os.getpid() or pid <= 0:
        return False
    if not pid_alive(pid):
        return False
    started = process_start_time(pid)
    try:  # a process started after the entry was last written reuses a dead writer's pid
        return started is None or started <= p.lstat().st_mtime + 1.0
    except OSError:
        return False


def clean_partial(directory: Path) -> list[Path]:
    """Removes ``.tmp`` directories of interrupted flushes; returns what it removed.

    A ``.old-<pid>`` copy (a committed step moved aside while a new copy of the
    same step replaced it) whose replacement never arrived is renamed back: it
    is the only committed copy of that step. Entries of a writer that is still
    running on this host are left alone (it is flushing right now).
    """
    d = Path(directory)
    removed = []
    for p in [*d.glob("step-*.old-*"), *d.glob("step-*/rank-*.old-*")]:
        if _writer_alive(p):
            continue
        orig = p.with_name(p.name.split(".old-")[0])
        if not orig.exists():
            try:
                os.rename(p, orig)
                log.warning("restored %s: its replacement was interrupted", orig)
                continue
            except OSError:
                pass
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for p in [*d.glob("step-*.tmp*"), *d.glob("step-*/rank-*.tmp-*")]:
        if _writer_alive(p):
            log.info("leaving %s: its writer (a flush in progress) is alive", p)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for p in d.glob(f".{LATEST}.tmp-*"):
        if not _writer_alive(p):
            p.unlink(missing_ok=True)
    return removed
