"""cudasnap/_C.pyi covers every binding of the compiled engine, and its TypedDicts
name exactly the keys the engine's dicts carry (so mypy's key checks are real)."""
from __future__ import annotations

import ast
import ctypes
from pathlib import Path

import pytest

from cudasnap._native import native

STUB = Path(__file__).resolve().parents[2] / "cudasnap" / "_C.pyi"
CUDA_ONLY = {"CudaCopyEngine", "cuda_device_count", "register_arena", "unregister_arena",
             "create_private_pinned_arena", "attach_allocator_tracker",
             "attached_allocator_registry"}


def stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text())


def top_level_names(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and not (isinstance(node.annotation, ast.Name) and node.annotation.id == "TypeAlias")):
            out.add(node.target.id)
    return out


def stub_class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def members(cls: ast.ClassDef) -> set[str]:
    out = set()
    for n in cls.body:
        if isinstance(n, ast.FunctionDef):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def test_every_binding_is_in_the_stub():
    C = native()
    runtime = {n for n in dir(C) if not n.startswith("__")}
    stub = top_level_names(stub_tree())
    missing = runtime - stub
    assert not missing, f"bindings missing from cudasnap/_C.pyi: {sorted(missing)}"
    extra = stub - runtime - {"NativeModule", "SlotInfo", "FlushStats", "CoverageReport",
                              "RegistryStats", "BuildInfo"}
    if "cuda" not in C.BUILD_INFO["backends"]:
        extra -= CUDA_ONLY
    assert not extra, f"cudasnap/_C.pyi declares what the engine lacks: {sorted(extra)}"


@pytest.mark.parametrize("cls", ["Arena", "CopyPlan", "CopyJob", "CopyEngine", "CpuCopyEngine",
                                 "AllocatorRegistry", "CancelFlag", "MetaPrefix", "LayoutGuard"])
def test_every_method_is_in_the_stub(cls):
    C = native()
    tree = stub_tree()
    declared = members(stub_class(tree, cls))
    node = stub_class(tree, cls)
    for base in node.bases:  # inherited stub members
        if isinstance(base, ast.Name) and base.id in dir(C):
            declared |= members(stub_class(tree, base.id))
    runtime = {n for n in vars(getattr(C, cls)) if not n.startswith("_") or n == "__len__"}
    assert runtime - declared == set(), sorted(runtime - declared)


def test_typed_dicts_match_the_engines_dicts(tmp_path):
    tree = stub_tree()

    def keys(name: str) -> set[str]:
        return members(stub_class(tree, name))

    C = native()
    assert set(C.BUILD_INFO) == keys("BuildInfo")
    a = C.Arena.create(str(tmp_path / "arena"), 2, 1 << 16, 4096, 4096, "j", prefault=False)
    try:
        assert set(a.slot_info(0)) == keys("SlotInfo")
    finally:
        a.unlink()
    buf = (ctypes.c_uint8 * 8192)()
    st = C.write_buffer_file(ctypes.addressof(buf), 8192, 4096, str(tmp_path / "d"), durable=False)
    assert set(st) == keys("FlushStats")
    r = C.AllocatorRegistry()
    assert set(r.stats()) == keys("RegistryStats")
    assert set(r.coverage(0, [(4096, 10)])) == keys("CoverageReport")
