"""Tests reach the package's private parts only through tests/helpers/parts.py (issue 47):
no other file under tests/ names a private attribute of cudasnap, so a change of a
component's insides changes that one file, not the suite.

The rule, per file (``ast``; a name is private when it starts with one ``_``, dunders aside):

* ``from cudasnap[.m] import _n`` where ``cudasnap[.m]._n`` is not a module of the package
  (a private *module*, ``cudasnap._native``, ``cudasnap._testing``, ``_C``, is a unit with its
  own tests and may be imported; what is private inside it may not);
* ``x._n`` (read, write, call), and the same spelled as a string: ``getattr``/``setattr``/
  ``hasattr``/``delattr(x, "_n")``, ``monkeypatch.setattr(x, "_n", ...)``,
  ``mock.patch.object(x, "_n")``, and a dotted target ``"cudasnap.m._n"``. Not counted: ``x``
  rooted in ``self``/``cls`` (the test's own class), in a module imported from outside the
  repository (``torch._dynamo``, ``os._exit``), ``_n`` a private module of the package
  (``cudasnap._native``), or ``_n`` one of FOREIGN, private names of torch and the standard
  library reached on a local object (a tensor's ``_version``).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HOME = TESTS / "helpers" / "parts.py"  # the one place allowed

# Private names of torch and the standard library, reached on a local object.
FOREIGN = {
    "_version",  # torch.Tensor: its in-place version counter
    "_save_to_state_dict", "_register_state_dict_hook",
    "_register_load_state_dict_pre_hook",  # torch.nn.Module's hooks
    "_is_owned",  # threading.RLock / Condition
}
# Explicit exceptions: (file relative to tests/, private name). Keep short; say why.
ALLOWED: set[tuple[str, str]] = set()

ATTR_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_modules() -> set[str]:
    pkg = REPO / "cudasnap"
    mods = {"cudasnap", "cudasnap._C"}
    for p in pkg.rglob("*.py"):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if "build" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        mods.add(".".join(parts))
    return mods


MODULES = _package_modules()


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node


# The package and the suite's own helpers (what they hand a test may be cudasnap's); a
# name imported from anywhere else (torch, os, tools/) is not the package's.
OURS = {"cudasnap", "helpers", "tests"}
# Private modules of the package, reached as an attribute (``cudasnap._native``), as
# importing them is allowed.
PRIVATE_MODULES = {m.rsplit(".", 1)[-1] for m in MODULES if _is_private(m.rsplit(".", 1)[-1])}


def _foreign_roots(tree: ast.AST) -> set[str]:
    """Names the file binds by importing a module from outside this repository."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] not in OURS:
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module \
                and n.module.split(".")[0] not in OURS:
            out.update(a.asname or a.name for a in n.names)
    return out


def _counts(receiver: ast.expr, name: str, foreign: set[str]) -> bool:
    if not _is_private(name) or name in FOREIGN or name in PRIVATE_MODULES:
        return False
    root = _root(receiver)
    return not (isinstance(root, ast.Name) and root.id in {"self", "cls", "super"} | foreign)


def _dotted_private(text: str) -> str | None:
    """``"cudasnap.a.b._n..."`` -> ``_n`` (the first private part that is not a module)."""
    if not text.startswith("cudasnap."):
        return None
    bits = text.split(".")
    for i, b in enumerate(bits):
        if _is_private(b) and ".".join(bits[: i + 1]) not in MODULES:
            return b
    return None


def reaches(source: str) -> list[tuple[int, str]]:
    """(line, private name) of each reach into cudasnap's private parts in ``source``."""
    tree = ast.parse(source)
    foreign = _foreign_roots(tree)
    out: list[tuple[int, str]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module \
                and (n.module == "cudasnap" or n.module.startswith("cudasnap.")):
            out += [(n.lineno, a.name) for a in n.names
                    if _is_private(a.name) and f"{n.module}.{a.name}" not in MODULES]
        elif isinstance(n, ast.Attribute) and _counts(n.value, n.attr, foreign):
            out.append((n.lineno, n.attr))
        elif isinstance(n, ast.Call):
            f = n.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else ""
            args = n.args
            if fname in ATTR_CALLS | {"object"} and len(args) >= 2 \
                    and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) \
                    and _counts(args[0], args[1].value, foreign):
                out.append((n.lineno, args[1].value))
            for a in args[:1]:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) \
                        and fname in ATTR_CALLS | {"setattr", "delattr", "patch"}:
                    hit = _dotted_private(a.value)
                    if hit:
                        out.append((n.lineno, hit))
    return sorted(set(out))


def test_the_rule_sees_each_form() -> None:
    cases = {
        "snap._copier.job": ["_copier"],
        "parts.prep(snap)._cancel.set()": ["_cancel"],
        "from cudasnap.core.copy_back import _PLAIN, run": ["_PLAIN"],
        "monkeypatch.setattr(Layouts, '_build_layout', spy)": ["_build_layout"],
        "getattr(snap, '_keeper')": ["_keeper"],
        "mock.patch.object(early, '_wait')": ["_wait"],
        "monkeypatch.setattr('cudasnap.storage.posix._check_trust', f)": ["_check_trust"],
        "from cudasnap import _native\n_native._library_path()": ["_library_path"],
        "C = native()\nC._crc32c_impl(b'')": ["_crc32c_impl"],
        "from helpers import parts\nparts.prep(snap)._cancel": ["_cancel"],
    }
    for src, want in cases.items():
        assert [name for _, name in reaches(src)] == want, src
    clean = ("import os, torch\nfrom tools.dist import spawn_worker\nspawn_worker._restore()\n"
             "from cudasnap import _native, _C\nfrom cudasnap._testing import faults\n"
             "os._exit(0)\ntorch._dynamo.reset()\nt._version\nself._x = 1\n"
             "super()._save_to_state_dict(a)\nmonkeypatch.setattr('cudasnap._points.hit', f)\n"
             "x.__class__\n")
    assert reaches(clean) == []


def test_no_test_reaches_a_private_part_but_through_parts() -> None:
    files = [p for p in TESTS.rglob("*.py") if p != HOME]
    assert len(files) > 100, len(files)
    bad = [f"{p.relative_to(TESTS)}:{line}: {name}" for p in sorted(files)
           for line, name in reaches(p.read_text())
           if (str(p.relative_to(TESTS)), name) not in ALLOWED]
    assert not bad, ("a test reaches a private part of cudasnap; put the reach in a named "
                     "function of tests/helpers/parts.py:\n" + "\n".join(bad))
