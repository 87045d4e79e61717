"""setup.py's first-use messages (issue 26), without building anything: the line said
before compiling (backend, architectures, file count, about how long, the CPU-only
hint), and the early stop naming each missing build tool and the README's line."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup_py() -> dict[str, Any]:
    argv = sys.argv
    sys.argv = [str(ROOT / "setup.py"), "--name"]  # setup() prints the name and returns
    try:
        return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")
    finally:
        sys.argv = argv


STEPS = [
    "[1/5] Building CXX object CMakeFiles/_C.dir/csrc/crc32c.cpp.o",
    "[2/5] Building CXX object CMakeFiles/_C.dir/csrc/python/restore_spans.cpp.o",  # torch headers
    "[3/5] Building CUDA object CMakeFiles/_C.dir/csrc/cuda/gather.cu.o",
    "[4/5] Building CXX object CMakeFiles/_C.dir/csrc/python/bindings.cpp.o",  # pybind11
    "[5/5] Linking CXX shared module lib/_C.cpython-311-x86_64-linux-gnu.so",
]


def _cache(tmp_path: Path, backend: str, archs: str = "90") -> Path:
    (tmp_path / "CMakeCache.txt").write_text(
        f"CUDASNAP_CUDA_ARCHS:STRING={archs}\nCUDASNAP_CUDA_BACKEND:INTERNAL={backend}\n")
    return tmp_path


def test_the_line_before_compiling_names_the_cuda_archs_and_the_cpu_only_switch(setup_py, tmp_path) -> None:
    line = setup_py["_plan_line"](_cache(tmp_path, "ON", "80;90-real"), STEPS, 2)
    assert line.startswith("building the CUDA backend for sm_80, sm_90 and the CPU backend: 4 source file(s), about ")
    assert "CUDASNAP_WITH_CUDA=0 builds the CPU backend only" in line


def test_the_line_for_a_cpu_only_build_says_why(setup_py, tmp_path) -> None:
    off = setup_py["_plan_line"](_cache(tmp_path, "OFF: CUDASNAP_WITH_CUDA=0"), STEPS[:2], 2)
    assert off.startswith("building the CPU backend only (CUDASNAP_WITH_CUDA=0): 2 source file(s)")
    no_nvcc = setup_py["_plan_line"](_cache(tmp_path, "OFF: the installed torch is not a CUDA build"), STEPS, 2)
    assert "no CUDA backend: the installed torch is not a CUDA build" in no_nvcc


def test_estimate_counts_heavy_sources_the_link_and_the_cores(setup_py) -> None:
    est = setup_py["estimate_seconds"]
    heavy, light, cu, link = (setup_py[k] for k in ("_COST_HEAVY_S", "_COST_LIGHT_S", "_COST_CU_S", "_COST_LINK_S"))
    assert est(STEPS, 1) == pytest.approx(2 * heavy + light + cu + link)
    assert est(STEPS, 2) == pytest.approx((2 * heavy + light + cu) / 2 + link)
    assert est(STEPS, 64) == pytest.approx(heavy + link)  # the slowest file bounds it
    assert est([], 2) == 0


def test_missing_tools_stop_before_compiling_naming_each_and_the_fix(setup_py, monkeypatch, capsys) -> None:
    g = setup_py["missing_build_tools"].__globals__
    monkeypatch.setitem(g, "_has_bdist_wheel", lambda: False)
    monkeypatch.setitem(g, "_cmake_exe", lambda: "/usr/bin/cmake")
    monkeypatch.setitem(g, "_cmake_version", lambda exe: (3, 25))
    assert setup_py["missing_build_tools"]({"egg_info"}) == []  # metadata alone: nothing checked
    missing = setup_py["missing_build_tools"]({"dist_info"})
    assert [m.split(" ")[0] for m in missing] == ["wheel:", "cmake"], missing
    assert "3.26 or later (/usr/bin/cmake is 3.25)" in missing[1]
    assert [m.split(" ")[0] for m in setup_py["missing_build_tools"]({"build_ext"})] == ["cmake"]
    with pytest.raises(SystemExit) as e:
        setup_py["check_build_tools"](["setup.py", "bdist_wheel"])
    msg = str(e.value.code)
    assert "wheel: setuptools" in msg and "pip install setuptools wheel pybind11 cmake ninja" in msg
    assert "--no-build-isolation" in msg
    # the README's build-tools line is the one named
    assert setup_py["BUILD_TOOLS"] in (ROOT / "README.md").read_text()


def test_readme_extras_table_lists_setup_py_extras() -> None:
    """'Adding an extra later': the packages the README names are setup.py's extras_require."""
    import ast
    import re

    call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    text = (ROOT / "README.md").read_text()
    table = text[text.index("**Adding an extra later**"):text.index("## Quick start")]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", table, re.M))
    assert rows.keys() == extras.keys(), (rows, extras)
    for name, reqs in extras.items():
        assert re.findall(r'"([^"]+)"', rows[name]) == reqs, (name, rows[name], reqs)
