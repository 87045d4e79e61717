"""The native test-only kill points (csrc/test_hooks.h) are armed only by an explicit
call (cudasnap._testing.faults.arm_kill -> _C._arm_test_hook), never from the
environment by the engine itself; armed, they SIGKILL the process at their phase."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import parts

from cudasnap._native import native
from cudasnap._testing import faults

ROOT = Path(__file__).resolve().parents[2]

# Writes a 64 KiB buffer to a file with the native flusher (kill phases "write", "fsync").
CHILD = textwrap.dedent("""
    import ctypes, os, sys
    from cudasnap._native import native
    from cudasnap._testing import faults
    C = native()
    how, path = sys.argv[1], sys.argv[2]
    if how == "arm":
        faults.arm_kill("write")
    elif how == "env-late":
        os.environ[faults.KILL_ENV] = "write"   # after import: must not arm the engine
    buf = (ctypes.c_uint8 * 65536)()
    C.write_buffer_file(ctypes.addressof(buf), 65536, 4096, path, threads=1, durable=False)
    print("ALIVE", flush=True)
""")


def run_child(how: str, path: Path, env_at_start: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != faults.KILL_ENV}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if env_at_start:
        env[faults.KILL_ENV] = env_at_start
    return subprocess.run([sys.executable, "-c", CHILD, how, str(path)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how,env_at_start,dies", [
    ("arm", None, True),           # explicit arming kills at "write"
    ("none", None, False),         # nothing armed: the flush completes
    ("env-late", None, False),     # the engine never reads the environment itself
    ("none", "write", True),       # set at process start: _testing arms at import
    ("none", "fsync@2", False),    # armed for the 2nd fsync: one flush survives
])
@pytest.mark.slow
def test_native_kill_point(tmp_path, how, env_at_start, dies):
    p = run_child(how, tmp_path / "data.bin", env_at_start)
    if dies:
        assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
        assert "ALIVE" not in p.stdout
    else:
        assert p.returncode == 0, p.stderr[-2000:]
        assert "ALIVE" in p.stdout
        assert (tmp_path / "data.bin").stat().st_size == 65536


def test_arming_is_checked_and_reversible():
    C = native()
    with pytest.raises(Exception, match="unknown native kill phase 'nope'"):
        parts.arm_native_hook(C, "kill_at", "nope")
    with pytest.raises(ValueError, match="unknown test hook"):
        parts.arm_native_hook(C, "explode", "write")
    with pytest.raises(ValueError, match="bad kill spec"):
        faults.arm_kill("write@zero")
    assert set(faults.NATIVE_PHASES) == set(parts.native_kill_phases(C))
    try:
        faults.arm_kill("fsync@3")
        assert parts.armed_kill_phase(C) == "fsync"
        faults.arm_kill("latest")  # a Python phase: the native hook is disarmed
        assert parts.armed_kill_phase(C) == ""
    finally:
        faults.arm_kill(None)
    assert parts.armed_kill_phase(C) == ""
