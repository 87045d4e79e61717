"""Build metadata: the torch the extension was built against, and the refusal to
load it under another torch (issue 11). Also the compile check's failure path."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import parts

import cudasnap
from cudasnap import _native
from cudasnap.errors import SnapshotError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_native(monkeypatch):
    monkeypatch.setattr(_native, "_C", None)
    monkeypatch.delenv("CUDASNAP_ALLOW_TORCH_MISMATCH", raising=False)
    return _native


def test_build_info_reports_the_torch_built_against():
    info = cudasnap.build_info()
    assert info["torch_built_against"] == torch.__version__
    assert info["torch"] == torch.__version__
    lib = parts.library_path()
    assert lib and _native.built_torch_version(lib) == torch.__version__, (
        "the torch version marker must be readable from the library file without loading it")


def test_loadable_extension_built_for_another_torch_is_refused(fresh_native, monkeypatch):
    fake = types.SimpleNamespace(BUILD_INFO={"torch": "2.11.0+cu130"}, __file__="/x/_C.so")
    monkeypatch.setattr(fresh_native.importlib, "import_module", lambda name: fake)
    with pytest.raises(SnapshotError) as ei:
        fresh_native.native()
    msg = str(ei.value)
    assert "built against torch 2.11.0+cu130" in msg and f"runs torch {torch.__version__}" in msg
    assert "--no-build-isolation" in msg
    assert fresh_native._C is None


def test_mismatch_override_warns_and_loads(fresh_native, monkeypatch, caplog):
    fake = types.SimpleNamespace(BUILD_INFO={"torch": "2.11.0"}, __file__="/x/_C.so")
    monkeypatch.setattr(fresh_native.importlib, "import_module", lambda name: fake)
    monkeypatch.setenv("CUDASNAP_ALLOW_TORCH_MISMATCH", "1")
    assert fresh_native.native() is fake
    assert "2.11.0" in caplog.text


def test_unloadable_extension_names_both_versions(fresh_native, monkeypatch, tmp_path):
    lib = tmp_path / "_C.so"
    lib.write_bytes(b"\x7fELF junk\0" + _native.MARKER + b"2.6.0+cu124\0more")

    def fail(name):
        raise ImportError("undefined symbol: _ZN3c1019UndefinedTensorImpl10_singletonE")

    monkeypatch.setattr(fresh_native.importlib, "import_module", fail)
    parts.replace_library_path(monkeypatch, fresh_native, lambda: str(lib))
    with pytest.raises(SnapshotError) as ei:
        fresh_native.native()
    msg = str(ei.value)
    assert "built against torch 2.6.0+cu124" in msg and f"runs torch {torch.__version__}" in msg
    assert "undefined symbol" in msg


def test_compile_check_finds_the_torch_dependent_sources():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import compile_check
    finally:
        sys.path.pop(0)
    dependent = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.cpp")
                 if compile_check.uses_torch_headers(p.resolve())}
    assert {"csrc/python/restore_spans.cpp", "csrc/cuda/tracker_hook.cpp"} <= dependent
    assert "csrc/python/layout_check.cpp" not in dependent  # kept off torch's Python headers (build time)
    assert "csrc/crc32c.cpp" not in dependent


def test_compile_check_fails_on_a_header_mismatch(tmp_path):
    """A torch whose headers lack what csrc uses must fail the check (and make test)."""
    inc = tmp_path / "cache" / "9.9.0" / "torch" / "include"
    for rel in ("torch/csrc/autograd/python_variable.h", "torch/version.h",
                "c10/cuda/CUDACachingAllocator.h", "c10/cuda/CUDAFunctions.h"):
        (inc / rel).parent.mkdir(parents=True, exist_ok=True)
        (inc / rel).write_text("#pragma once\n#define TORCH_VERSION_MAJOR 9\n#define TORCH_VERSION_MINOR 9\n")
    (tmp_path / "cache" / "9.9.0" / ".complete").write_text("fake\n")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_check.py"), "--no-installed",
                        "--torch", "9.9.0", "--cache", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "torch 9.9.0: FAIL csrc/python/restore_spans.cpp" in p.stdout
    assert "FAILED for torch 9.9.0" in p.stdout
