"""Issue 36 item 1: docs/design.md §2.1 lists every use of one Snapshotter component by
another (each call and each field read), and this test keeps the list true.

The uses are found by AST in cudasnap/core and the facade: ``self._x.member`` where
``self._x`` holds a component (typed by the constructor parameter it came from, by the
class it was made of, or by the ``Components`` tuple the facade unpacks), and the same
through local aliases (``copier = self._copier``, ``live = self.live``,
``state = self._copier.live``) and through parameters typed with a component
(``fences.install(state, copier: Copier, ...)``). ``Counters`` is left out: plain data
every component increments (design.md says so in its table).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "cudasnap"
DESIGN = REPO / "docs" / "design.md"
COMPONENTS = {"Timeline", "Backend", "Layouts", "ArenaKeeper", "ArenaPreparer", "Copier",
              "PendingBoundary", "Cadence", "Flusher", "Restorer", "EarlySaver"}
# the module of each class whose uses are listed (fences.py: the hooks, caller "fences")
MODULES = ["core/timeline.py", "core/backend.py", "core/plan_cache.py", "core/arena_keeper.py",
           "core/arena_preparer.py", "core/copier.py", "core/pending_boundary.py", "core/cadence.py",
           "core/flush.py", "core/restore.py", "core/early.py", "core/fences.py",
           "snapshotter.py"]


def _ann(node: ast.expr | None) -> str | None:
    """The component a parameter annotation names (``Copier``, ``"Copier"``, ``Copier | None``)."""
    if node is None:
        return None
    text = ast.unparse(node).strip("'\"")
    for part in re.split(r"[|\s\[\],]+", text):
        if part in COMPONENTS:
            return part
    return None


def _components_fields() -> list[str | None]:
    """The facade's ``Components`` tuple: each field's component (None: not one)."""
    tree = ast.parse((PKG / "core" / "wiring.py").read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef) and n.name == "Components":
            return [_ann(s.annotation) for s in n.body if isinstance(s, ast.AnnAssign)]
    raise AssertionError("no Components in core/wiring.py")


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr | None]]:
    if isinstance(target, ast.Tuple):
        if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
            return list(zip(target.elts, value.elts))
        return [(t, None) for t in target.elts]
    return [(target, value)]


def field_types(tree: ast.Module) -> dict[str, dict[str, str]]:
    """Per class: ``self.<field>`` -> the component it holds."""
    out: dict[str, dict[str, str]] = {}
    comps = _components_fields()
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        fields: dict[str, str] = {}
        for fn in [f for f in cls.body if isinstance(f, ast.FunctionDef)]:
            params = {a.arg: _ann(a.annotation) for a in fn.args.args + fn.args.kwonlyargs}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple) \
                        and isinstance(n.value, ast.Name) and n.value.id == "parts":
                    for t, comp in zip(n.targets[0].elts, comps):
                        if isinstance(t, ast.Attribute) and comp:
                            fields[t.attr] = comp
                    continue
                targets = n.targets if isinstance(n, ast.Assign) else \
                    [n.target] if isinstance(n, ast.AnnAssign) and n.value is not None else []
                for tgt in targets:
                    for t, v in _pairs(tgt, n.value):  # type: ignore[attr-defined]
                        if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id == "self"):
                            continue
                        comp = None
                        if isinstance(v, ast.Name):
                            comp = params.get(v.id)
                        elif isinstance(v, ast.Call) and isinstance(v.func, ast.Name) \
                                and v.func.id in COMPONENTS:
                            comp = v.func.id
                        if comp:
                            fields[t.attr] = comp
        out[cls.name] = fields
    return out


def uses(rel: str, all_fields: dict[str, dict[str, str]]) -> set[tuple[str, str, str]]:
    """(caller, component, member) for each use in module ``rel``."""
    tree = ast.parse((PKG / rel).read_text())
    found: set[tuple[str, str, str]] = set()
    scopes: list[tuple[str, ast.AST]] = []  # (caller, a method or a class-level property)
    for top in tree.body:
        if isinstance(top, ast.ClassDef):
            scopes += [(top.name, f) for f in top.body]
        elif isinstance(top, ast.FunctionDef):
            owner = next((c for c in all_fields if any(
                _ann(a.annotation) == c for a in top.args.args)), None)
            scopes.append((owner if owner and rel != "core/fences.py" else
                           Path(rel).stem, top))
    for caller, fn in scopes:
        own = all_fields.get(caller, {})
        names: dict[str, str] = {}

        def typed(e: ast.expr, names: dict[str, str] = names, own: dict[str, str] = own,
                  caller: str = caller) -> str | None:
            if isinstance(e, ast.Name):
                return names.get(e.id)
            if isinstance(e, ast.Attribute):
                if isinstance(e.value, ast.Name) and e.value.id == "self":
                    return own.get(e.attr)
                base = typed(e.value)
                if base is not None:
                    return all_fields.get(base, {}).get(e.attr)
            return None

        for n in ast.walk(fn):
            if isinstance(n, (ast.FunctionDef, ast.Lambda)):
                for a in n.args.args + n.args.kwonlyargs:
                    comp = _ann(a.annotation)
                    if comp:
                        names[a.arg] = comp
        for _ in range(2):  # aliases of aliases
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for tgt in n.targets:
                        for t, v in _pairs(tgt, n.value):
                            if isinstance(t, ast.Name) and v is not None and typed(v):
                                names[t.id] = typed(v)  # type: ignore[assignment]
        for n in ast.walk(fn):
            if isinstance(n, ast.Attribute) and not isinstance(n.ctx, ast.Store):
                comp = typed(n.value)
                if comp and comp != caller:
                    found.add((caller, comp, n.attr))
    return found


def code_uses() -> set[tuple[str, str, str]]:
    all_fields: dict[str, dict[str, str]] = {}
    for rel in MODULES:
        all_fields.update(field_types(ast.parse((PKG / rel).read_text())))
    return set().union(*(uses(rel, all_fields) for rel in MODULES))


def documented() -> set[tuple[str, str, str]]:
    text = DESIGN.read_text()
    block = re.search(r"<!-- component uses: .*? -->\n```\n(.*?)```", text, re.S)
    assert block, "docs/design.md §2.1 has no component-uses block"
    out = set()
    for line in block.group(1).splitlines():
        m = re.fullmatch(r"\s*(\w+) -> (\w+): (.*)", line)
        assert m, f"bad line in the component-uses block: {line!r}"
        out |= {(m[1], m[2], member.strip()) for member in m[3].split(",")}
    return out


def test_the_finder_sees_fields_aliases_and_typed_parameters() -> None:
    code = ("class Copier:\n    pass\nclass Flusher:\n"
            "    def __init__(self, copier: Copier) -> None:\n        self._copier = copier\n"
            "    def flush(self):\n        c = self._copier\n        c.wait_job(1)\n"
            "        self._copier.live.clean()\n"
            "def helper(copier: 'Copier | None'):\n    return copier.job\n")
    tree = ast.parse(code)
    assert field_types(tree) == {"Copier": {}, "Flusher": {"_copier": "Copier"}}


def test_design_lists_every_use_between_components() -> None:
    got, doc = code_uses(), documented()
    missing = sorted(got - doc)
    stale = sorted(doc - got)
    fmt = "\n".join
    assert not missing and not stale, (
        "docs/design.md §2.1 component uses out of date:\n  in the code, not listed:\n    "
        + fmt(f"{a} -> {b}: {m}" for a, b, m in missing) + "\n  listed, not in the code:\n    "
        + fmt(f"{a} -> {b}: {m}" for a, b, m in stale))


def test_no_component_calls_the_facade_back() -> None:
    """Nothing in core/ holds the Snapshotter or a flush of it: the keeper's regrowth and
    the final flush go to ``Flusher.flush_newest`` / ``Flusher.final_flush``."""
    for f in sorted((PKG / "core").glob("*.py")):
        text = f.read_text()
        assert "Snapshotter.flush" not in re.sub(r'""".*?"""', "", text, flags=re.S), f
        assert "facade.flush" not in text, f


# The one part below the facade still handed the facade itself: the guard, whose policy
# acts as the program would (flush, then exit or go on; cudasnap.triggers.guard).
HANDED_THE_FACADE = {"Guard"}


def test_nothing_below_the_facade_is_handed_it_but_the_guard() -> None:
    """Issue 47: the coordinator used to hold the Snapshotter (``SnapshotterLocal(self)``)
    and called it back, ``settle_newest`` while the flush lock was held; it now holds the
    components (``ComponentsLocal``). A new ``X(self)`` in the facade fails here."""
    tree = ast.parse((PKG / "snapshotter.py").read_text())
    handed = sorted({ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)
                     and any(isinstance(a, ast.Name) and a.id == "self"
                             for a in [*n.args, *(k.value for k in n.keywords)])})
    assert set(handed) <= HANDED_THE_FACADE, handed
