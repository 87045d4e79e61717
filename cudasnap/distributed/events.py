"""The coordinator's event log: one JSON line per event in ``DIR/dist-log.jsonl``.

Events: flush_start (with ``target`` when an explicit flush opened the round), agreed,
agree_failed, written, committed, commit_failed, closed_peers (a flush that opened no
round: peers had closed), closed (this rank's clean close, its final committed step),
restore_start, restored, progress (the step a rank reached: rank 0 and the last rank, at
their first boundary and then every ``PROGRESS_EVERY_S``: a restart that can restore
nothing then knows, and says, how far the job had got); each with wall-clock time, rank,
epoch and thread.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..format.paths import DIST_LOG as EVENT_LOG

log = logging.getLogger("cudasnap.distributed")
PROGRESS_EVERY_S = 5.0


class EventLog:
    def __init__(self, directory: Path, rank: int, epoch: int) -> None:
        self.path = Path(directory) / EVENT_LOG
        self.rank = rank
        self.epoch = epoch

    def __call__(self, event: str, **kw: Any) -> None:
        rec = {"t": time.time(), "rank": self.rank, "epoch": self.epoch, "event": event,
               "thread": threading.current_thread().name, **kw}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, (json.dumps(rec) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("event log: %s", e)


def read_events(directory: Path) -> list[dict[str, Any]]:
    """The coordinator events of ``directory``."""
    try:
        lines = (Path(directory) / EVENT_LOG).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
