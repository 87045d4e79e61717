"""The README's quick start runs as written, and does what it says: killed mid-run
(os._exit right after a boundary, no flush, no supervisor), the re-run resumes from
shared memory and ends bitwise equal to a run that never failed (prefetched batch X
and RNG included)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BOUNDARY = "    snap.boundary(step, X=X)"


def quick_start() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None, "README: no python block under '## Quick start'"
    code = m.group(1)
    assert BOUNDARY in code and "snap.close()" in code, code
    return code


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDASNAP_JOB": f"qs-{os.getpid()}-{cwd.name}"}
    env.pop("CUDASNAP_DIR", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


@pytest.mark.slow
def test_quick_start_survives_a_kill_and_resumes_bitwise(tmp_path: Path) -> None:
    # Seeded so that the reference and the killed run start from the same init.
    code = ("import torch; torch.manual_seed(0)\n" + quick_start() +
            'torch.save(model.state_dict(), "final.pt")\n')
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    r = _run(code, ref)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = code.replace(BOUNDARY, BOUNDARY + "\n    if step == 60: import os; os._exit(9)")
    r = _run(killed, run)
    assert r.returncode == 9, r.stderr[-3000:]
    assert not (run / "final.pt").exists()
    r = _run(code, run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"resum\w* .*step (59|60)|step (59|60).*resum", r.stderr, re.I), r.stderr[-3000:]
    a, b = torch.load(ref / "final.pt"), torch.load(run / "final.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: the resumed run differs from the uninterrupted one"
