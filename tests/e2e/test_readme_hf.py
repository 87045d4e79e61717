"""The README's Hugging Face Trainer section runs as written (issue 44 item 6): its python
block, saved as hf_quick.py, is killed at step 33 by its own ``--kill`` (os._exit: no
flush, no clean-up), run again (it resumes from the snapshot in shared memory), and its
final model is bitwise equal to a run that never failed; the bash block runs verbatim and
its last line prints True."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def hf_section() -> tuple[str, str]:
    from test_readme_quickstart import readme_blocks

    code, script = readme_blocks("## Hugging Face Trainer")
    for needed in ("CudaSnapTrainerCallback(", "resume_from_checkpoint=snap.resume_checkpoint()",
                   '"--kill" in sys.argv', "os._exit(", 'trainer.save_model("final")'):
        assert needed in code, f"README HF section lost {needed!r}:\n{code}"
    assert "hf_quick.py --kill" in script and "print(" in script, script
    return code, script


@pytest.mark.slow
def test_the_readme_hf_snippet_resumes_bitwise_after_a_kill(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    code, script = hf_section()
    (tmp_path / "hf_quick.py").write_text(code)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("CUDASNAP_DIR", "CUDASNAP_JOB", "CUDASNAP_FRESH", "CUDASNAP_RESTART",
                 "CUDASNAP_INJECT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    work = tmp_path / "work"
    work.mkdir()
    (work / "hf_quick.py").symlink_to(tmp_path / "hf_quick.py")
    r = subprocess.run(["bash", "-c", script], cwd=work, env=env, text=True,
                       capture_output=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    resumed = re.findall(r"resumed at global step (\d+)", out)
    assert resumed and 30 <= int(resumed[0]) <= 33, out[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "True", out[-4000:]
