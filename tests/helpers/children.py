"""Test files that run themselves as child processes (``python FILE MODE ...``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_script(script: str | Path, mode: str, *args: Any, timeout: float = 240,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``python SCRIPT MODE ARGS`` from the repository root with the repository on
    PYTHONPATH, the test's environment (the emulator's included) less CUDASNAP_HEALTH,
    plus ``env``; output captured."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("CUDASNAP_HEALTH", None)
    if env:
        e.update(env)
    return subprocess.run([sys.executable, str(Path(script).resolve()), mode, *map(str, args)],
                          cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)


def last_json(p: subprocess.CompletedProcess) -> dict[str, Any]:
    """The child's last stdout line that is a JSON object."""
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line from the child (rc {p.returncode}):\n{p.stdout}\n{p.stderr}")
