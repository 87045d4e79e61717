"""TEST-ONLY crash points of the Python commit path.

``CUDASNAP_TEST_KILL_AT=<phase>`` (or ``<phase>@<n>``: the n-th time) makes the
process SIGKILL itself at that phase. The C++ engine has the phases
copy/header/write/fsync; the storage layer has manifest/rename/replace/renamed/
latest (posix) and upload/manifest/commit (fsspec). Only the fault tests
(tests/test_faults.py, tests/test_s3.py, bench/faults.py) set it; unset, a
``kill_point`` is one environment lookup.
"""
from __future__ import annotations

import os
import signal

KILL_ENV = "CUDASNAP_TEST_KILL_AT"

_kill_hits: dict[str, int] = {}


def kill_point(phase: str) -> None:
    """SIGKILLs this process at ``phase`` when $CUDASNAP_TEST_KILL_AT says so."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    name, _, nth = want.partition("@")
    if name != phase:
        return
    _kill_hits[phase] = _kill_hits.get(phase, 0) + 1
    if _kill_hits[phase] >= max(1, int(nth or 1)):
        os.kill(os.getpid(), signal.SIGKILL)
