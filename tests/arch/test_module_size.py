"""No Python module of the package over 450 lines (issue 24): a module that grows past it is
split along its seams (see docs/design.md, "File size"), not left to grow."""
from __future__ import annotations

from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cudasnap"
LIMIT = 450


def test_no_module_over_the_limit() -> None:
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines())
             for p in PKG.rglob("*.py")}
    assert len(sizes) > 50, sorted(sizes)  # the walk found the package
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them): {over}"


FUNCTION_LIMIT = 80  # lines, signature and docstring included (issue 36)


def test_no_function_over_one_screen() -> None:
    import ast

    long: dict[str, int] = {}
    n = 0
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n += 1
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > FUNCTION_LIMIT:
                    long[f"{p.relative_to(PKG)}:{node.lineno} {node.name}"] = size
    assert n > 500, n  # the walk found the package's functions
    assert not long, f"functions over {FUNCTION_LIMIT} lines (split them): {long}"
