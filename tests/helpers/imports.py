"""The package's modules and the cudasnap modules each one imports, read with ``ast``
(tests/arch/test_layers.py: floors; tests/arch/test_import_graph.py: cycles).

Every import statement counts: module level, inside functions and under
``if TYPE_CHECKING:``.
"""
from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``root/cudasnap/a/b.py`` -> ``cudasnap.a.b`` (a package's ``__init__`` -> the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py (and compiled stub .pyi) under ``root/cudasnap``."""
    pkg = root / "cudasnap"
    out: dict[str, Path] = {}
    for pattern in ("*.py", "*.pyi"):
        for p in sorted(pkg.rglob(pattern)):
            if "build" in p.relative_to(pkg).parts:
                continue
            out.setdefault(module_name(p, root), p)
    return out


def imports_of(mod: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, target module) of every cudasnap import in the file: the longest module
    the import names (``from pkg import sub`` names pkg.sub when that is a module)."""
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                src = ".".join(anchor + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        else:
            continue
        for t in names:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != mod and (t == "cudasnap" or t.startswith("cudasnap.")):
                out.append((node.lineno, t))
    return out
