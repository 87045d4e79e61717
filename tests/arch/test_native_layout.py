"""The native engine is free of Python (issue 24): only ``csrc/python/`` (the pybind11
bindings and the code that walks ``PyObject*``: layout check, restore pairs, host
watch) may include ``Python.h``, pybind11 or torch's Python headers, or name the
CPython API. Everything else under ``csrc/`` (``csrc/cuda/`` included) is the engine:
plain C++ over memory, files and CUDA, as TransformerEngine's ``common/`` is to its
``pytorch/csrc``. Reads the sources only; builds nothing."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
PYTHON_SIDE = CSRC / "python"
SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
# The CPython C API (PyObject, Py_ssize_t, Py_INCREF, PyList_GET_ITEM, ...),
# torch's Python tensor API (THPVariable_*) and pybind11 (namespace or macros).
PY_NAME = re.compile(r"\b(PyObject|PyTypeObject|Py_\w+|Py[A-Z][A-Za-z]*_\w+|THP\w+|pybind11|PYBIND11_\w+)\b")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')


def python_includes(text: str) -> list[str]:
    """The includes of `text` that bring in Python: Python.h, pybind11, torch's
    Python-facing headers (torch/extension.h, torch/csrc/.../python_*.h,
    torch/csrc/Dtype.h) or a header of csrc/python/."""
    out = []
    for inc in INCLUDE.findall(text):
        low = inc.lower()
        if (inc == "Python.h" or low.startswith("pybind11/") or "python" in low
                or inc in ("torch/extension.h", "torch/csrc/Dtype.h")):
            out.append(inc)
    return out


def python_names(text: str) -> list[str]:
    """CPython / pybind11 identifiers in the code of `text` (comments and string
    literals left out: a comment may say "the GIL" or "Python")."""
    code = STRING.sub('""', COMMENT.sub(" ", text))
    return sorted(set(PY_NAME.findall(code)))


def engine_sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*")
                  if p.suffix in SUFFIXES and PYTHON_SIDE not in p.parents)


def test_the_scan_finds_python_in_a_source():
    bad = ('#include <Python.h>\n#include "python/host_watch.h"\n#include <pybind11/stl.h>\n'
           "#include <torch/csrc/autograd/python_variable.h>\n"
           "int f(PyObject* o) { Py_ssize_t n = PyList_GET_SIZE(o); return THPVariable_Check(o); }\n")
    assert python_includes(bad) == ["Python.h", "python/host_watch.h", "pybind11/stl.h",
                                    "torch/csrc/autograd/python_variable.h"]
    assert python_names(bad) == ["PyList_GET_SIZE", "PyObject", "Py_ssize_t", "THPVariable_Check",
                                 "pybind11"]
    clean = ('// holds the GIL? never: no PyObject here, see "Python.h"\n'
             '#include <c10/cuda/CUDAFunctions.h>\n#include "error.h"\n'
             'const char* s = "PyObject"; /* Py_INCREF */ int python_side = 0;\n')
    assert python_includes(clean) == [] and python_names(clean) == []


def test_the_engine_includes_no_python_and_names_no_pyobject():
    sources = engine_sources()
    assert CSRC / "error.h" in sources and CSRC / "cuda" / "tracker_hook.cpp" in sources
    found = {}
    for src in sources:
        text = src.read_text()
        bad = python_includes(text) + python_names(text)
        if bad:
            found[src.relative_to(ROOT).as_posix()] = bad
    assert not found, ("Python in the native engine; move the Python-facing piece to csrc/python/ "
                       f"(the bindings and the code that walks PyObject*): {found}")


@pytest.mark.parametrize("name", ["bindings.h", "bindings.cpp", "bindings_staging.cpp",
                                  "bindings_tracker.cpp", "layout_check.cpp", "restore_spans.cpp",
                                  "host_watch.cpp"])
def test_the_python_side_lives_in_csrc_python(name):
    assert (PYTHON_SIDE / name).is_file()
    assert not (CSRC / name).exists()


def test_cmake_builds_every_source_of_both_sides():
    """Every .cpp outside csrc/cuda/ (globbed there) is named in CMakeLists.txt, so a
    moved or split source cannot drop out of the module."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    listed = {s for s in re.findall(r"\bcsrc/[\w/]+\.cpp\b", cmake) if not s.startswith("csrc/cuda/")}
    sources = {p.relative_to(ROOT).as_posix() for p in CSRC.rglob("*.cpp")
               if (CSRC / "cuda") not in p.parents}
    assert sources == listed, (sorted(sources - listed), sorted(listed - sources))


def test_the_thread_pool_knows_none_of_its_users():
    """thread_pool.{h,cpp} is the generic pool (issue 47): no engine header but its own,
    no call into the flusher; a caller that yields to a flush passes a predicate
    (BatchOptions::should_yield = flush_running)."""
    for name in ("thread_pool.h", "thread_pool.cpp"):
        text = (CSRC / name).read_text()
        local = [inc for inc in re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, re.M)
                 if inc != "thread_pool.h"]
        code = STRING.sub('""', COMMENT.sub(" ", text))
        assert not local, f"csrc/{name} includes engine headers: {local}"
        assert not re.search(r"\bflush_\w+", code), f"csrc/{name} calls into the flusher"
