"""Fault points: product code reaches named points (cudasnap._points) and never imports the
test hooks; the hooks (cudasnap._testing) install themselves, or are loaded by name in a
process a test starts with a CUDASNAP_TEST_* variable (issue 24: imports that point up)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import parts

from cudasnap import _points

REPO = Path(__file__).resolve().parents[2]


def test_no_product_module_imports_the_test_hooks() -> None:
    bad = []
    for f in (REPO / "cudasnap").rglob("*.py"):
        rel = f.relative_to(REPO)
        if rel.parts[1] == "_testing":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            if any("_testing" in n for n in names):
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, bad


def test_reach_runs_installed_hooks_only(monkeypatch) -> None:
    seen: list[tuple[str, dict]] = []
    parts.clear_fault_points(monkeypatch)
    _points.reach("manifest")  # no hook: nothing
    _points.install("t", lambda point, info: seen.append((point, info)))
    _points.reach("dist.flush_written", rank=1, step=7)
    assert seen == [("dist.flush_written", {"rank": 1, "step": 7})]


CHILD = """
import sys, torch, cudasnap
m = torch.nn.Linear(4, 4); o = torch.optim.SGD(m.parameters(), lr=0.1)
s = cudasnap.Snapshotter(m, o, directory=sys.argv[1], backend="cpu", health=False)
m(torch.ones(2, 4)).sum().backward(); o.step(); s.boundary(0); s.wait(); s.flush()
print("survived", flush=True)
"""


@pytest.mark.slow
def test_a_child_started_with_the_variable_gets_the_hooks(tmp_path: Path, snap_env) -> None:
    """Nothing imports cudasnap._testing in the child: _points loads it because the
    environment asks, and the kill point of the flush fires. The children's arenas (kept
    at exit, as for a restart) are named by snap_env's job, which removes them after."""
    env = dict(os.environ, CUDASNAP_TEST_KILL_AT="latest", PYTHONPATH=str(REPO))
    assert env["CUDASNAP_JOB"] == snap_env.job
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ck")], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9 and "survived" not in r.stdout, (r.returncode, r.stderr[-2000:])
    env.pop("CUDASNAP_TEST_KILL_AT")
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ck2")], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "survived" in r.stdout, r.stderr[-2000:]
