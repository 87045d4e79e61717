"""bench/ and tools/ stand on the package (and on tools/), never on tests/ (issue 47): no
import of ``tests``, no ``tests`` directory put on ``sys.path``."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REACH = re.compile(r"^\s*(from tests[.\s]|import tests\b)|sys\.path\.insert\(.*[\"']tests[\"']",
                   re.M)
# Still on tests/: the whole fault matrix is built on tests/helpers/faultlib.py and three
# helper modules of the suite (issue 47 leaves it for a later change).
KNOWN = {"bench/faults.py"}


def test_bench_and_tools_do_not_reach_into_tests() -> None:
    files = [*REPO.glob("bench/*.py"), *REPO.glob("tools/**/*.py")]
    reach = sorted(str(f.relative_to(REPO)) for f in files if REACH.search(f.read_text()))
    assert reach == sorted(KNOWN), reach
