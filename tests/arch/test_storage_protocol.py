"""Storage behind its protocol (issue 36): the components and the coordinators reach
snapshots through the storage object (``has_step``, ``read_ahead``, ``open_data``, ...), never
through the local backend's module, so an object-store directory is never looked up as a
local path."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cudasnap"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            out.update(f"{base}.{a.name}" if node.module is None or not node.level
                       else f"{base}:{a.name}" for a in node.names)
            out.add(base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_component_imports_the_local_backend() -> None:
    found = {}
    files = [*(PKG / "core").glob("*.py"), *(PKG / "distributed").glob("*.py")]
    assert len(files) > 40
    for p in files:
        bad = {i for i in _imports(p) if "storage.posix" in i or i.endswith("storage:posix")}
        if bad:
            found[str(p.relative_to(PKG))] = sorted(bad)
    assert not found, f"imports of storage.posix (use the storage object): {found}"


def test_both_storages_answer_the_protocol() -> None:
    from cudasnap.storage import PosixStorage
    from cudasnap.storage.fsspec import FsspecStorage

    for cls in (PosixStorage, FsspecStorage):
        for m in ("has_step", "read_ahead", "open_data", "list_snapshots", "load_manifest",
                  "read_data", "write_slot", "clean_partial", "progress_evidence"):
            assert callable(getattr(cls, m, None)), (cls.__name__, m)
