"""The facade's keywords: each documented, and ``num_slots`` meaning what was asked
(issue 47 item 4 and its misleading names)."""
from __future__ import annotations

import inspect
import re

import pytest
import torch
from helpers import parts

from cudasnap import Snapshotter
from cudasnap.core.options import Options


def documented_args(doc: str) -> set[str]:
    """The names of a Google-style docstring's ``Args:`` entries (``a / b:`` names two)."""
    body = doc.partition("Args:\n")[2]
    names: set[str] = set()
    for line in body.splitlines():
        m = re.match(r"^ {8}([a-z_][a-z0-9_ /]*):", line)
        if m:
            names |= {n.strip() for n in m.group(1).split("/")}
        elif line.strip() and not line.startswith(" " * 9):
            break  # the section ended
    return names


def test_every_snapshotter_keyword_is_documented() -> None:
    params = set(inspect.signature(Snapshotter.__init__).parameters) - {"self"}
    doc = Snapshotter.__doc__ or ""
    assert documented_args(doc) >= {"model", "num_slots", "chunk_bytes", "policy", "inject"}
    missing = params - documented_args(doc)
    assert not missing, f"Snapshotter's docstring has no Args entry for {sorted(missing)}"
    # the scan sees one dropped
    dropped = re.sub(r"\n {8}inject:.*?(?=\n {8}[a-z_])", "", doc, flags=re.S)
    assert "inject" not in documented_args(dropped)


def test_options_come_in_groups() -> None:
    groups = {f for f in Options.__dataclass_fields__}
    assert groups == {"arena", "copy", "flush", "health", "dist", "waits"}


@pytest.mark.parametrize("kw, asked, in_all", [({}, 2, 3), ({"num_slots": 3}, 3, 4),
                                               ({"spare_slot": False}, 2, 2)])
def test_num_slots_is_what_was_asked(snap_env, kw, asked, in_all) -> None:
    """Before: Snapshotter(num_slots=2).num_slots == 3 (the arena's, spare included)."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, flush_on_close=False,
                       **kw)
    try:
        assert (snap.num_slots, snap.arena_slots) == (asked, in_all)
        opt.step()
        snap.boundary(0)
        assert snap.wait(30)
        assert parts.arena(snap).num_slots == in_all  # the arena made has them all
    finally:
        snap.close()
