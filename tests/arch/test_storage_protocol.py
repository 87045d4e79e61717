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


def _protocol_methods() -> set[str]:
    from cudasnap.storage.protocol import Storage

    return {n for n, v in vars(Storage).items() if not n.startswith("_")
            and (callable(v) or isinstance(v, classmethod))}


def test_every_registered_backend_answers_the_whole_protocol() -> None:
    """One seam: each backend of the registry has every method of ``Storage`` (one rank,
    many ranks, reading), so nothing above asks which backend it holds."""
    from cudasnap.storage import registry

    wanted = _protocol_methods()
    assert {"write_slot", "write_rank", "commit", "present", "open_data", "open"} <= wanted
    classes = {registry.backend_of(u) for u in ("/tmp/x", "s3://b/p", "objdir:///tmp/x",
                                                "memory://b/p")}
    assert {c.__name__ for c in classes} == {"PosixStorage", "FsspecStorage",
                                             "ObjectDirStorage"}
    for cls in classes:
        missing = sorted(m for m in wanted if not callable(getattr(cls, m, None)))
        assert not missing, (cls.__name__, missing)


def _code_words(path: Path) -> list[str]:
    """Names, attributes, imports and string constants of ``path``'s code (docstrings and
    comments left out: the docs may name a backend)."""
    tree = ast.parse(path.read_text())
    docs = {id(b.body[0].value) for b in ast.walk(tree)
            if isinstance(b, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and b.body and isinstance(b.body[0], ast.Expr)
            and isinstance(b.body[0].value, ast.Constant)}
    out: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.ImportFrom):
            out.append(n.module or "")
            out.extend(a.name for a in n.names)
        elif isinstance(n, ast.Import):
            out.extend(a.name for a in n.names)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.append(n.value)
    return out


def test_a_backend_is_one_module_and_one_registry_line() -> None:
    """The ``objdir://`` backend was added as ``storage/object_dir.py`` and its line in
    ``storage/registry.py``: no other module of the package names it."""
    names = ("object_dir", "ObjectDirStorage", "objdir")
    found = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
             if any(n in t for n in names for t in _code_words(p))}
    assert found == {"storage/object_dir.py", "storage/registry.py"}, found
    assert sum("object_dir" in w for w in _code_words(PKG / "storage" / "registry.py")) == 1


def test_no_module_picks_a_backend_but_the_registry() -> None:
    """Only the registry (and the backends themselves) make a backend from a URL."""
    found = {}
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel in ("storage/registry.py", "storage/object_dir.py", "storage/fsspec.py",
                   "storage/posix.py"):
            continue
        calls = [n.func.id if isinstance(n.func, ast.Name) else n.func.attr
                 for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)
                 and isinstance(n.func, (ast.Name, ast.Attribute))]
        made = sorted({c for c in calls if c in ("FsspecStorage", "PosixStorage",
                                                   "ObjectDirStorage")})
        if made:
            found[rel] = made
    assert not found, f"backends made outside storage.registry: {found}"
