"""The GPU runner's workflow: schema-valid, and it runs the quick GPU check and uploads its table."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "gpu.yml"
LINTER = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))

pytestmark = pytest.mark.skipif(LINTER is None, reason="check-jsonschema not installed (requirements-dev.txt)")


def _lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINTER), "--builtin-schema", "vendor.github-workflows", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_gpu_workflow_is_schema_valid() -> None:
    r = _lint(WORKFLOW)
    assert r.returncode == 0, r.stdout + r.stderr


def test_linter_rejects_a_broken_workflow(tmp_path: Path) -> None:
    text = WORKFLOW.read_text()
    bad = tmp_path / "bad.yml"
    bad.write_text(text.replace("runs-on:", "runs_on:", 1))  # a misspelt key
    r = _lint(bad)
    assert r.returncode != 0, "a job without runs-on passed the schema check"


def test_workflow_runs_the_quick_check_on_a_gpu_runner_and_uploads_the_table() -> None:
    text = WORKFLOW.read_text()
    assert "runs-on: [self-hosted, gpu]" in text
    assert "bash bench/gpu_check.sh --quick" in text
    assert "actions/upload-artifact" in text and "gpu_check_table.md" in text
