"""Layers point down (issue 24): every module of ``cudasnap/`` sits on a floor, and imports
only from its own floor or the floors below it.

Floors, lowest first (``FLOORS``)::

    leaves    errors, config, env_parse, _points, _native, _proc, _C   (no package below)
    format    names, manifests, codec                        (what is on disk)
    storage   where snapshots live; the byte counters and progress bars of their I/O
    core      the Snapshotter's mechanisms, and _cuda (the CUDA glue they drive)
    services  triggers, dist                                 (reach core through narrow protocols)
    facade    snapshotter, the package itself (cudasnap/__init__.py)
    apps      tools, integrations, demo, supervisor, modelling, _autoload, __main__
    test-only _testing

Every import statement counts: module level, inside functions (lazy) and under
``if TYPE_CHECKING:`` (a type-only import is still a dependency; tests/arch/test_import_graph.py
takes the same view of cycles). A failure names the module, the line and the target.

``_testing`` is the top floor, so a product module importing the test hooks fails here like
any other upward import; tests/arch/test_fault_points.py checks the same rule on its own (and
that the hooks are loaded by name, through ``cudasnap._points``, only when a test's
environment asks), so this file adds no second test of it.

Imports between packages of one floor (triggers <-> dist, leaves among themselves) are
allowed; cycles are tests/arch/test_import_graph.py's business. ``ALLOWED`` lists the upward
edges kept on purpose, each with its reason; an entry that is no longer needed fails.
"""
from __future__ import annotations

from pathlib import Path

from helpers.imports import imports_of, modules

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "cudasnap"

# Lowest first. An entry names a module or a package (and everything under it); the root
# package "cudasnap" names cudasnap/__init__.py only.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("cudasnap.errors", "cudasnap.config", "cudasnap.env_parse", "cudasnap._points",
                "cudasnap._native",
                "cudasnap._proc", "cudasnap._C")),
    ("format", ("cudasnap.format",)),
    ("storage", ("cudasnap.storage",)),
    ("core", ("cudasnap.core", "cudasnap._cuda")),
    ("services", ("cudasnap.triggers", "cudasnap.distributed")),
    ("facade", ("cudasnap.snapshotter", "cudasnap")),
    ("apps", ("cudasnap.tools", "cudasnap.integrations", "cudasnap.demo", "cudasnap.supervisor",
              "cudasnap.modelling", "cudasnap._autoload", "cudasnap.__main__")),
    ("test-only", ("cudasnap._testing",)),
]

# Upward edges kept on purpose: (importer, imported module) -> why.
ALLOWED: dict[tuple[str, str], str] = {
    # none (issue 36: cudasnap.load_resharded's reader moved from tools/ to core/dcp_load)
}


def floor_of(mod: str) -> int | None:
    """Index of ``mod``'s floor in FLOORS (the longest matching entry), or None."""
    best: tuple[int, int] | None = None
    for i, (_, entries) in enumerate(FLOORS):
        for e in entries:
            hit = mod == e or (e != "cudasnap" and mod.startswith(e + "."))
            if hit and (best is None or len(e) > best[1]):
                best = (i, len(e))
    return None if best is None else best[0]


def upward_imports(root: Path = REPO) -> tuple[list[str], set[tuple[str, str]], list[str]]:
    """(violations as "file:line: module [floor] imports target [floor]", the allowed
    edges seen, modules with no floor)."""
    mods = modules(root)
    known = set(mods)
    bad: list[str] = []
    used: set[tuple[str, str]] = set()
    unassigned = sorted(m for m in mods if floor_of(m) is None)
    for mod, path in mods.items():
        if path.suffix != ".py":
            continue
        fm = floor_of(mod)
        if fm is None:
            continue
        for line, target in imports_of(mod, path, known):
            ft = floor_of(target)
            if ft is None or ft <= fm:
                continue
            if (mod, target) in ALLOWED:
                used.add((mod, target))
                continue
            bad.append(f"{path.relative_to(root)}:{line}: {mod} [{FLOORS[fm][0]}] imports "
                       f"{target} [{FLOORS[ft][0]}]")
    return sorted(bad), used, unassigned


def test_every_module_has_a_floor() -> None:
    _, _, unassigned = upward_imports()
    assert not unassigned, ("modules on no floor (add their package to FLOORS in "
                            f"tests/arch/test_layers.py): {unassigned}")


def test_imports_point_down() -> None:
    bad, _, _ = upward_imports()
    assert not bad, "imports of a higher floor:\n" + "\n".join(bad)


def test_every_allowed_upward_import_is_still_there() -> None:
    _, used, _ = upward_imports()
    gone = set(ALLOWED) - used
    assert not gone, f"no longer imported upward: remove from ALLOWED: {sorted(gone)}"


def test_the_check_sees_upward_imports(tmp_path: Path) -> None:
    """A lazy import in a function, a TYPE_CHECKING one, ``import cudasnap`` from below the
    facade and an import of the test hooks all fail, naming file, line and target."""
    pkg = tmp_path / "cudasnap"
    for d in ("format", "core", "_testing"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "core" / "copy_plan.py").write_text("from ..format import paths\n")  # down: fine
    (pkg / "format" / "paths.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..errors import X\n"                 # down: fine
        "if TYPE_CHECKING:\n"
        "    from ..core.copy_plan import Layout\n"  # line 4: up (type-only counts)
        "def f():\n"
        "    import cudasnap\n"                    # line 6: up, to the facade
        "    from .. import _testing\n")           # line 7: up, the test hooks
    bad, _, unassigned = upward_imports(tmp_path)
    assert unassigned == []
    assert bad == [
        "cudasnap/format/paths.py:4: cudasnap.format.paths [format] imports cudasnap.core.copy_plan [core]",
        "cudasnap/format/paths.py:6: cudasnap.format.paths [format] imports cudasnap [facade]",
        "cudasnap/format/paths.py:7: cudasnap.format.paths [format] imports cudasnap._testing "
        "[test-only]",
    ], bad
