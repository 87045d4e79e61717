"""Top-down paths (issue 47 item 3): the restore calls down only, and a boundary's host state
is captured, then encoded, in one pass.

* The storage hands a restore its data file as a record (``storage.data_file.DataFile``: no
  copy logic, no native reader); core reads it (``core.file_copy``) and never calls a copying
  method of it back (``read``, ``scatter``, ``scatter_device``).
* ``core.host_capture``'s capture (``HostText.capture`` and what it calls) makes no call into
  ``format.slot_manifest``: only ``HostText.parts`` hands the finished record down to it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cudasnap"
COPYING = {"read", "scatter", "scatter_device"}


def _tree(rel: str) -> ast.Module:
    return ast.parse((PKG / rel).read_text())


def test_the_storage_hands_the_data_file_as_a_record() -> None:
    tree = _tree("storage/data_file.py")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "native" not in names and "_native" not in mods, "the record reads nothing itself"
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DataFile"]
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert "__init__" in methods and "stop_ahead" in methods
    assert not methods & COPYING, f"DataFile copies: {sorted(methods & COPYING)}"


def test_core_never_calls_the_storage_back_to_copy() -> None:
    found = []
    for p in sorted((PKG / "core").glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in {"scatter", "scatter_device"}):
                found.append(f"{p.name}:{n.lineno}")
    assert not found, f"core calls a storage copy back: {found}"
    reads = _tree("core/file_copy.py")
    called = {n.func.attr for n in ast.walk(reads) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute)}
    assert {"run_file", "read_file_scatter", "read_file_to_device"} <= called


def test_the_host_state_is_captured_then_encoded() -> None:
    tree = _tree("core/host_capture.py")
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HostText"]
    uses: dict[str, set[str]] = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef):
            uses[fn.name] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                             and isinstance(n.value, ast.Name) and n.value.id == "sm"}
    assert "capture" in uses
    assert uses.pop("parts") == {"host_pieces"}
    assert not any(uses.values()), f"the capture calls the format: {uses}"
