"""The README's quick start runs as written, and shows what it claims: the script
(seeded) is killed at step 60 by its own ``--kill`` (os._exit right after a boundary:
no flush, no supervisor), run again (it resumes from shared memory), and its final
model is bitwise equal to a run that never failed (prefetched batch X, scheduler and
RNG included). The python block is saved as quickstart.py and the bash block that
follows it runs verbatim, its last line printing True."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def readme_blocks(title: str) -> tuple[str, str]:
    """The first python and bash blocks of the README's section ``title``."""
    text = (REPO / "README.md").read_text()
    start = text.index(title)
    section = text[start:text.index("\n## ", start + 1)]
    py = re.search(r"```python\n(.*?)```", section, re.S)
    sh = re.search(r"```bash\n(.*?)```", section, re.S)
    assert py is not None and sh is not None, f"README: '{title}' needs a python and a bash block"
    return py.group(1), sh.group(1)


def quick_start() -> tuple[str, str]:
    """The python and bash blocks of the README's '## Quick start' section."""
    code, script = readme_blocks("## Quick start")
    for needed in ("torch.manual_seed(", '"--kill" in sys.argv', "os._exit(", "snap.close()",
                   'torch.save(model.state_dict(), "final.pt")'):
        assert needed in code, f"README quick start lost {needed!r}:\n{code}"
    assert "quickstart.py --kill" in script and "torch.equal" in script, script
    return code, script


@pytest.mark.slow
def test_quick_start_as_written_resumes_bitwise_after_a_kill(tmp_path: Path) -> None:
    code, script = quick_start()
    (tmp_path / "quickstart.py").write_text(code)
    bin_dir = tmp_path / "bin"  # `python` in the README's commands: this interpreter
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # (a venv's python
    (bin_dir / "python").chmod(0o755)  # finds its site-packages only by its own path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    for name in ("CUDASNAP_DIR", "CUDASNAP_JOB", "CUDASNAP_FRESH", "CUDASNAP_RESTART", "CUDASNAP_INJECT"):
        env.pop(name, None)
    work = tmp_path / "work"
    work.mkdir()
    (work / "quickstart.py").symlink_to(tmp_path / "quickstart.py")  # "../quickstart.py" from a/ and b/
    r = subprocess.run(["bash", "-c", script], cwd=work, env=env, text=True, capture_output=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # the killed run left no final model; the second one resumed from the kill's snapshot
    assert re.search(r"resuming at step (60|61)\b", r.stderr), out[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "True", out[-3000:]
    a, b = torch.load(work / "a" / "final.pt"), torch.load(work / "b" / "final.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: the resumed run differs from the uninterrupted one"
