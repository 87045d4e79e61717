"""TEST-ONLY crash points, in the Python commit path and in the native engine.

A kill point SIGKILLs this process the n-th time it reaches an armed phase. The
native engine (csrc/test_hooks.h) has the phases copy/header/write/fsync; the
storage layer has manifest/rename/replace/renamed (posix), latest (storage/latest) and
upload/manifest/commit (fsspec). Tests arm them explicitly with
``arm_kill("<phase>")`` or ``arm_kill("<phase>@<n>")`` (``arm_kill(None)``
disarms); the native hooks are only ever armed through this call.

``CUDASNAP_TEST_KILL_AT=<phase>[@<n>]`` in the environment when this module is
first imported arms the same way (for subprocess tests); the Python phases also
honour it when it is set later while nothing is armed explicitly. Unset and
unarmed, a Python ``kill_point`` is one environment lookup and a native one a
relaxed atomic load.
"""
from __future__ import annotations

import os
import signal

from .. import _points

KILL_ENV = "CUDASNAP_TEST_KILL_AT"
NATIVE_PHASES = ("copy", "header", "write", "fsync")

_armed: tuple[str, int] | None = None  # set by arm_kill
_native_armed = False
_kill_hits: dict[str, int] = {}


def parse_spec(spec: str) -> tuple[str, int]:
    """``"phase"`` or ``"phase@n"`` -> (phase, n); ValueError naming a bad spec."""
    name, _, nth = spec.partition("@")
    bad = f"{KILL_ENV}: bad kill spec {spec!r} (want <phase> or <phase>@<n>, n >= 1)"
    try:
        n = int(nth or 1)
    except ValueError:
        raise ValueError(bad) from None
    if not name or n < 1:
        raise ValueError(bad)
    return name, n


def arm_kill(spec: str | None) -> None:
    """Arms the kill point ``spec`` (Python and native phases), or disarms with None/""."""
    global _armed, _native_armed
    _kill_hits.clear()
    _armed = parse_spec(spec) if spec else None
    if _armed is not None and _armed[0] in NATIVE_PHASES:
        from .._native import native  # loads torch: only when a native phase is armed

        native()._arm_test_hook("kill_at", _armed[0], _armed[1])
        _native_armed = True
    elif _native_armed:
        from .._native import native

        native()._disarm_test_hooks()
        _native_armed = False


def kill_point(phase: str) -> None:
    """SIGKILLs this process at ``phase`` when it is armed (or $CUDASNAP_TEST_KILL_AT says so)."""
    if _armed is not None:
        name, nth = _armed
    else:
        want = os.environ.get(KILL_ENV)
        if not want:
            return
        name, nth = parse_spec(want)
    if name != phase:
        return
    _kill_hits[phase] = _kill_hits.get(phase, 0) + 1
    if _kill_hits[phase] >= nth:
        os.kill(os.getpid(), signal.SIGKILL)


def _at_point(point: str, info: dict[str, object]) -> None:  # cudasnap._points hook
    kill_point(point)


_points.install("kill", _at_point)

if os.environ.get(KILL_ENV):  # a subprocess test started with the variable set
    arm_kill(os.environ[KILL_ENV])
