"""TEST-ONLY: holds the background arena set-up before it starts any work.

``cudasnap.core.arena_preparer`` reaches the point ``arena_prep.hold`` (cudasnap._points)
before a set-up's job and before its follow-up (the pre-fault). While ``gate`` is an
unset ``threading.Event`` the preparer thread waits there (tests release it to prove
that boundaries never wait for the arena); a cancel meanwhile ends the set-up with
StagingError, as a cancelled set-up does. ``gate`` None (the default): no wait.

    from cudasnap._testing import arena_gate
    monkeypatch.setattr(arena_gate, "gate", threading.Event())
"""
from __future__ import annotations

import threading

from .. import _points
from ..errors import StagingError

POINT = "arena_prep.hold"

gate: threading.Event | None = None


def _at_point(point: str, info: dict[str, object]) -> None:  # cudasnap._points hook
    if point != POINT:
        return
    held = gate
    cancel = info["cancel"]
    while held is not None and not held.wait(0.05):
        if cancel.is_set:  # type: ignore[attr-defined]
            raise StagingError("arena set-up cancelled before it started")


_points.install("arena_gate", _at_point)
