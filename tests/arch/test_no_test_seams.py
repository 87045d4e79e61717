"""No test seams in product code (issue 36 item 4): a test reaches a component through what
the facade owns (tests/helpers/parts.py), patches a function where it is defined or looked
up, or injects a fault at a named point (cudasnap._points); no product module keeps a view,
a re-export or a settable property for tests, nor says so in its text."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "cudasnap"

# What a seam kept for tests says about itself (case-insensitive).
PHRASES = ("for tests", "a test patching", "tests may replace", "a test may", "a test's patch",
           "so a test")
SEAM = re.compile("|".join(re.escape(p).replace(r"\ ", r"\s+") for p in PHRASES), re.IGNORECASE)


def seam_mentions(text: str) -> list[tuple[int, str]]:
    """(line, phrase) of each mention; a phrase may run over a line break."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group().split()))
            for m in SEAM.finditer(text)]


def test_the_finder_sees_the_old_seams() -> None:
    old = {  # what the seams' text said before issue 36
        "for tests": "# Read-only views of the components' state for tests, tests/helpers/...",
        "a test patching": "looks ``_write_file_durable`` up here too; a test patching it",
        "a test's patch": "(looked up on this module, so that a test's patch reaches them)",
        "Tests may replace": "``close()`` calls ``stop`` last. Tests may replace ``engine``",
        "a test may": "call ``copier.fence`` by attribute at each call (a test may\n replace it)",
        "so a test": "calls it once when it starts, so a test\n   or a supervisor",
    }
    for phrase, text in old.items():
        assert [p for _, p in seam_mentions(text)] == [" ".join(phrase.split())], phrase
    assert seam_mentions("x\ny, so a test\nz") == [(2, "so a test")]
    assert seam_mentions("tests/helpers/parts.py; the latest test point; contests") == []


def test_no_product_module_mentions_a_test_seam() -> None:
    files = sorted([*PKG.rglob("*.py"), *PKG.rglob("*.pyi")])
    assert len(files) > 50, "the package was not found"
    bad = [f"{f.relative_to(REPO)}:{line}: {phrase!r}"
           for f in files for line, phrase in seam_mentions(f.read_text(encoding="utf-8"))]
    assert not bad, ("product code describes a seam kept for tests; inject the component, "
                     "storage, clock or engine instead (tests/helpers/parts.py):\n"
                     + "\n".join(bad))
