"""bench/ and tools/ stand on the package (and on tools/), never on tests/ (issue 47): no
import of ``tests`` (nor of its ``helpers``), no ``tests`` directory put on ``sys.path``."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# ``helpers`` is the suite's package (tests/helpers/, importable once tests/ is on the path).
REACH = re.compile(r"^\s*(from (tests|helpers)[.\s]|import (tests|helpers)\b)"
                   r"|sys\.path\.insert\(.*[\"']tests[\"']", re.M)


def test_the_rule_sees_a_reach() -> None:
    for text in ("from tests.helpers import parts\n", "import tests.conftest\n",
                 "from helpers import x\nsys.path.insert(0, str(REPO / \"tests\"))\n",
                 "    from tests import conftest\n", "from helpers.parts import arena\n"):
        assert REACH.search(text), text
    assert not REACH.search("from tools.faults import matrix\nimport testsuite\n")


def test_bench_and_tools_do_not_reach_into_tests() -> None:
    files = [*REPO.glob("bench/*.py"), *REPO.glob("tools/**/*.py")]
    assert any(f.match("tools/faults/*.py") for f in files)  # the walk found them
    reach = sorted(str(f.relative_to(REPO)) for f in files if REACH.search(f.read_text()))
    assert reach == [], reach
