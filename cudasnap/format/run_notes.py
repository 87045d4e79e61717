"""What an attempt of ``cudasnap run`` tells its supervisor besides its exit status: a note
file beside the verdict (``CUDASNAP_RUN_VERDICT``, set by the supervisor for each attempt).

``started_over`` (issue 44 item 5): an attempt that restored nothing although the job had
made progress (``core.restore.Restorer``) writes ``<verdict>.started-over`` (0600, one
line, the newest such note wins); the supervisor reads it once the job ended
(:func:`read_started_over`) and says so in its summary, so a job that trained everything
again does not end in silence. Unlike the verdict it is not cleared per attempt.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import run_verdict_path

log = logging.getLogger("cudasnap")

STARTED_OVER = ".started-over"


def started_over(msg: str) -> None:
    """Records that this attempt starts over at step 0 after progress (no-op outside
    ``cudasnap run``)."""
    path = run_verdict_path()
    if not path:
        return
    target, tmp = path + STARTED_OVER, f"{path}{STARTED_OVER}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, msg.encode()[:4096])
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except OSError as e:  # the ERROR in this attempt's log stays the record
        log.warning("could not tell cudasnap run that this attempt starts over: %s", e)


def read_started_over(verdict: Path | None) -> str | None:
    """The note of the newest attempt that started over after progress, or None."""
    if verdict is None:
        return None
    try:
        return Path(str(verdict) + STARTED_OVER).read_text(errors="replace").strip() or None
    except OSError:
        return None
