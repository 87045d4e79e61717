"""The arena's slot limit is written once per language (issue 47): ``kMaxSlots`` in
csrc/staging.h (the header's slot table) and ``config.MAX_SLOTS`` in Python must agree, and
the option table of config.py's docstring states the same bound."""
from __future__ import annotations

import re
from pathlib import Path

from cudasnap import config

REPO = Path(__file__).resolve().parents[2]


def test_the_slot_limit_is_the_same_in_cpp_and_python() -> None:
    m = re.search(r"constexpr int kMaxSlots = (\d+);", (REPO / "csrc" / "staging.h").read_text())
    assert m, "csrc/staging.h no longer defines kMaxSlots"
    assert int(m.group(1)) == config.MAX_SLOTS
    row = re.search(r"^num_slots .*?int, 2 \.\. (\d+) - spare_slot", config.__doc__ or "", re.M)
    assert row and int(row.group(1)) == config.MAX_SLOTS, "config.py's option table"
