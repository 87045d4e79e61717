"""Finds the CUDA toolkit root (shared by setup.py and tools/compile_check.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def cuda_home() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                 "/usr/local/cuda", "/usr/local/cuda-13.0"):
        if cand and (Path(cand) / "include" / "cuda_runtime.h").exists():
            return str(Path(cand).resolve())
    nvcc = shutil.which("nvcc")
    if nvcc:
        # /usr/local/bin/nvcc may be a wrapper script: read the path it execs.
        text = Path(nvcc).read_text(errors="ignore") if Path(nvcc).stat().st_size < 4096 else ""
        for tok in text.split():
            if tok.endswith("/bin/nvcc"):
                root = Path(tok).parent.parent
                if (root / "include" / "cuda_runtime.h").exists():
                    return str(root)
        root = Path(nvcc).resolve().parent.parent
        if (root / "include" / "cuda_runtime.h").exists():
            return str(root)
    return None
