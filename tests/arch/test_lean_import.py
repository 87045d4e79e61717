"""``import cudasnap`` is cheap: no CUDA initialisation, the compiled engine loads lazily."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import cudasnap
import torch
report = {"cuda_initialized": torch.cuda.is_initialized(),
          "C_loaded_after_import": "cudasnap._C" in sys.modules,
          "errors_public": all(hasattr(cudasnap, n) for n in (
              "SnapshotError", "CorruptSnapshot", "IncompatibleSnapshot", "StagingError",
              "FlushError", "CudaError", "ConfigError"))}
info = cudasnap.build_info()
report["C_loaded_after_build_info"] = "cudasnap._C" in sys.modules
report["cuda_initialized_after_build_info"] = torch.cuda.is_initialized()
report["info"] = {k: (v if isinstance(v, (str, int, float, bool, list, type(None))) else repr(v))
                  for k, v in info.items()}
report["torch_version"] = torch.__version__
print(json.dumps(report))
"""


def _probe() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDASNAP_HEALTH"}
    p = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_is_lean_and_build_info_is_complete():
    r = _probe()
    assert r["cuda_initialized"] is False
    assert r["C_loaded_after_import"] is False, "cudasnap._C must load on first use only"
    assert r["errors_public"]
    assert r["C_loaded_after_build_info"] is True
    assert r["cuda_initialized_after_build_info"] is False
    info = r["info"]
    for key in ("version", "torch", "backends", "cuda_version", "cuda_architectures"):
        assert key in info, f"build_info() lacks {key!r}: {info}"
    import cudasnap

    assert info["version"] == cudasnap.__version__
    assert info["torch"] == r["torch_version"]
    assert isinstance(info["backends"], list) and "cpu" in info["backends"]
    if "cuda" in info["backends"]:
        assert info["cuda_version"] and info["cuda_architectures"]
    else:
        assert info["cuda_version"] is None
