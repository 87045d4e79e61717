"""The LiveState (issue 36 item 1): the one owner of "the newest boundary not copied while the
live tensors still hold it", and the order between a copy of it and a write of the state."""
from __future__ import annotations

import logging
import threading

from cudasnap.core.live_state import LiveState


def _recorded(step: int = 5, **kw: bool) -> LiveState:
    live = LiveState()
    live.boundary_starts()
    live.record(step, b"suffix", **kw)
    return live


def test_a_clean_boundary_is_claimed_once_and_cleared_when_copied() -> None:
    live = _recorded()
    assert live.pending() == (5, b"suffix") and live.clean()
    with live.claim() as got:
        assert got == (5, b"suffix")
        live.copied(got)
    assert live.pending() is None
    with live.claim() as again:
        assert again is None  # nothing left to copy


def test_a_write_since_the_boundary_leaves_nothing_to_copy(caplog) -> None:
    live = _recorded()
    assert live.mark_dirty() is None  # no copy running: the writer goes on at once
    with caplog.at_level(logging.INFO, logger="cudasnap"):
        with live.claim() as got:
            assert got is None
    assert "moved past step 5" in caplog.text
    assert live.pending() == (5, b"suffix")  # kept: a later boundary replaces it


def test_a_writer_during_the_copy_gets_its_event_and_waits_for_the_end_of_it() -> None:
    live = _recorded()
    with live.claim() as got:
        assert got is not None
        ev = live.mark_dirty()
        assert ev is not None and not ev.is_set()  # the writer must wait for it
        other: list[object] = []
        t = threading.Thread(target=lambda: other.append(live.claim().__enter__()))
        t.start()
        t.join(10)
        assert other == [None]  # a second thread never copies the same boundary too
    assert ev.is_set() and live.mark_dirty() is None


def test_a_boundary_replaced_during_the_copy_is_not_cleared() -> None:
    live = _recorded()
    with live.claim() as got:
        assert got is not None
        live.boundary_starts()
        live.record(6, b"newer")
        live.copied(got)
    assert live.pending() == (6, b"newer")


def test_deferred_and_unprotected_are_remembered_for_the_early_saver() -> None:
    live = _recorded(deferred=True, unprotected=True)
    assert live.deferred and live.unprotected_here()
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(live.unprotected_here()))
    t.start()
    t.join(10)
    assert seen == [False]  # another thread than the boundary's
    live.clear()
    assert live.pending() is None and not live.deferred
