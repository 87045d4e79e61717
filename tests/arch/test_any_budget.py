"""At most ``BUDGET`` uses of ``typing.Any`` in the components and the facade (issue 36 item 3):
the components are typed with their classes, the ``cudasnap/_C.pyi`` types, protocols
(``cudasnap/core/types.py`` and next to their consumers) and ``object`` where a value is opaque.

A use is a name ``Any`` or an attribute ``typing.Any`` anywhere in the module's code
(annotations, aliases, casts, ...), also inside a quoted annotation or a quoted ``cast``
type (a string does not hide one); ``from typing import Any`` itself is not a use.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cudasnap"
BUDGET = 20


def _quoted_types(tree: ast.AST) -> list[str]:
    """The strings that are types: quoted annotations and ``cast("T", x)``'s first argument."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            out += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                    if x is not None and x.annotation is not None]
            if node.returns is not None:
                out.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            out.append(node.annotation)
        elif isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Name) and node.func.id == "cast")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "cast")):
            out.append(node.args[0])
    return [n.value for n in out if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _uses(tree: ast.AST) -> int:
    return sum(1 for n in ast.walk(tree) if (isinstance(n, ast.Name) and n.id == "Any")
               or (isinstance(n, ast.Attribute) and n.attr == "Any"))


def any_uses(source: str) -> int:
    """Uses of ``Any`` in a module's source (see the module docstring)."""
    tree = ast.parse(source)
    n = _uses(tree)
    for text in _quoted_types(tree):
        try:
            n += _uses(ast.parse(text, mode="eval"))
        except SyntaxError:  # not a type expression: nothing to count
            continue
    return n


def test_any_uses_are_counted() -> None:
    src = ("from typing import Any\nimport typing\nfrom typing import cast\n"
           "x: Any = 1\n"
           "def f(a: 'list[Any]', b: typing.Any) -> dict[str, Any]:\n"
           "    '''Any in a docstring is prose.'''\n"
           "    return cast('dict[str, Any]', a)\n")
    assert any_uses(src) == 5
    assert any_uses("from typing import Any\n") == 0
    assert any_uses("x: object = 'Any'\n") == 0


def test_any_budget_of_core_and_snapshotter() -> None:
    files = sorted((PKG / "core").glob("*.py")) + [PKG / "snapshotter.py"]
    assert len(files) > 20, files  # the glob found the components
    counts = {str(p.relative_to(PKG)): any_uses(p.read_text()) for p in files}
    total = sum(counts.values())
    per_file = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])
                         if n)
    assert total <= BUDGET, (f"{total} uses of typing.Any in cudasnap/core/*.py and "
                             f"cudasnap/snapshotter.py, at most {BUDGET} (issue 36 item 3); "
                             f"per file: {per_file}")
