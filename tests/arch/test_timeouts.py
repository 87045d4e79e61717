"""Both lanes have a per-test timeout: a hang is a failure with a stack, never a stuck CI.

The CPU lane takes its limit from pyproject.toml, the emulated lane from the Makefile
(``-o timeout=$(EMU_TEST_TIMEOUT)``). A child pytest with the project's own settings and
a 2 s limit runs one test that blocks for ever in a lock and one that passes; the
blocked test fails with its stack.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_project_sets_a_thread_timeout_for_both_lanes() -> None:
    py = (REPO / "pyproject.toml").read_text()
    m = re.search(r"^timeout\s*=\s*(\d+)", py, re.M)
    assert m and 60 <= int(m.group(1)) <= 1800, "pyproject.toml: no per-test timeout"
    assert re.search(r'^timeout_method\s*=\s*"thread"', py, re.M)
    mk = (REPO / "Makefile").read_text()
    lane = next(ln for ln in mk.splitlines() if "pytest" in ln and "tests/cuda_emu" in ln)
    assert "-o timeout=$(EMU_TEST_TIMEOUT)" in lane
    assert re.search(r"^EMU_TEST_TIMEOUT \?= \d+", mk, re.M)


def test_a_hanging_test_fails_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import threading

        def test_ok():
            assert True

        def test_hangs_in_a_lock():
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns
    """))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=2",
         str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Timeout" in out, out
    assert "test_hangs_in_a_lock" in out and "lock.acquire()" in out, out  # the stack
