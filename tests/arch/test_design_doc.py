"""docs/design.md stays true to the code where it can be checked: every file it names exists,
and every "`Class` (`file.py`)" it states, and every component table row that puts a class
first beside its files, has the class defined in that file."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "design.md"
EXT = r"(?:py|pyi|cpp|h|cu|cuh|sh|md|txt|toml|yml|json|png|c)"
PATH = re.compile(rf"`([A-Za-z0-9_./{{}},*-]+\.{EXT})`")
CLASS_IN_FILE = re.compile(r"`([A-Z][A-Za-z0-9_]+)` \(`([A-Za-z0-9_./]+\.py)`\)")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    return [p for p in out if (REPO / p).exists()]


def _expand(token: str) -> list[str]:
    """``flusher.{h,cpp}`` -> both names; ``copy_engine*`` is left to the glob below."""
    m = re.match(r"(.*)\{([^}]*)\}(.*)", token)
    return [m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [token]


# Named on purpose though not in the tree: a header of another project, a placeholder path.
ELSEWHERE = {"Python.h", "rank-R/manifest.json"}
# Named as what is not there (or no longer): "was `plan.py`", "no `shared.py`", "DCP's `x`".
NOT_HERE = re.compile(r"(was|no|DCP's|/)\s*$")


def _resolves(name: str, files: list[str]) -> bool:
    name = name.lstrip("./")
    if name.startswith("/"):
        return False  # a path of one machine
    if "*" in name:
        pat = re.compile(re.escape(name).replace(r"\*", "[^/]*") + "$")
        return any(pat.search(f) for f in files)
    return any(f == name or f.endswith("/" + name) for f in files)


def test_every_file_the_design_names_exists() -> None:
    files = _tracked()
    text = DOC.read_text()
    missing = sorted({n for m in PATH.finditer(text) for n in _expand(m.group(1))
                      if n not in ELSEWHERE and not NOT_HERE.search(text[:m.start()][-8:])
                      and not _resolves(n, files)})
    assert missing == [], f"docs/design.md names files that are not in the tree: {missing}"
    # a table row's bare names live beside its first path: | `tools/a.py`, `b.py` |
    for row in text.splitlines():
        cells = row.split("|")
        named = re.findall(r"`([A-Za-z0-9_./{},*-]+\.[a-z]+)`", cells[1]) if len(cells) > 3 else []
        if named and "/" in named[0]:
            base = named[0].rsplit("/", 1)[0] + "/"
            missing += [base + n for n in named[1:] for x in _expand(n)
                        if "/" not in n and not _resolves(base + x, files)]
    assert missing == [], f"a table row of docs/design.md puts files in the wrong place: {missing}"


def _defines(cls: str, file: str, files: list[str]) -> bool:
    pat = re.compile(rf"^\s*(class|def) {re.escape(cls)}\b|^{re.escape(cls)} *[:=]", re.M)
    return any(pat.search((REPO / f).read_text(errors="replace"))
               for f in files if f == file or f.endswith("/" + file))


def test_every_class_the_design_places_is_defined_there() -> None:
    files = [f for f in _tracked() if f.endswith(".py")]
    text = DOC.read_text()
    wrong = [f"{c} in {f}" for c, f in CLASS_IN_FILE.findall(text) if not _defines(c, f, files)]
    for row in text.splitlines():  # | `dir/a.py`, `b.py` | `Class` ... | tests |
        cells = row.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        named = [n for n in re.findall(r"`([A-Za-z0-9_./]+\.py)`", cells[1])]
        first = re.match(r"\s*`([A-Z][A-Za-z0-9_]+)`", cells[2])
        if named and first:
            base = named[0].rsplit("/", 1)[0] + "/" if "/" in named[0] else ""
            cands = [n if "/" in n else base + n for n in named]
            if not any(_defines(first.group(1), c, files) for c in cands):
                wrong.append(f"{first.group(1)} in {cands}")
    assert wrong == [], f"docs/design.md places these where they are not defined: {wrong}"


def test_the_largest_cpp_file_the_design_names_is_the_largest() -> None:
    m = re.search(r"The largest C\+\+ file is\s+`([^`]+)`\s+\((\d+) lines", DOC.read_text())
    assert m, "docs/design.md no longer names the largest C++ file"
    sizes = {Path(f).name: len((REPO / f).read_text(errors="replace").splitlines())
             for f in _tracked() if f.startswith("csrc/") and f.endswith((".cpp", ".h", ".cu",
                                                                            ".cuh"))}
    biggest = max(sizes, key=lambda k: sizes[k])
    assert (m.group(1), int(m.group(2))) == (biggest, sizes[biggest])
