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
