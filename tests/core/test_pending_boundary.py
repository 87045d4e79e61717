"""The PendingBoundary (issue 36 item 1): the one owner of "the newest boundary not copied while the
live tensors still hold it", and the order between a copy of it and a write of the state."""
from __future__ import annotations

import logging
import threading

from cudasnap.core.pending_boundary import PendingBoundary


def _recorded(step: int = 5, **kw: bool) -> PendingBoundary:
    live = PendingBoundary()
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


def test_a_new_boundary_drops_the_older_one_before_it_records_its_own() -> None:
    """Between ``boundary_starts`` and the boundary's own ``record`` a flush must find
    nothing to copy: the tensors already hold the new step, not the older boundary's."""
    live = _recorded(step=5)
    live.mark_dirty()  # the next optimizer step
    live.boundary_starts()  # boundary 6 begins: clean again, but nothing recorded yet
    assert live.pending() is None
    with live.claim() as got:
        assert got is None


# ------------------------------------------------------------ the Copier around it
class _Engine:
    def __init__(self) -> None:
        self.fenced: list[object] = []
        self.submitted: list[int] = []

    def fence(self, job: object, phase: int, stream: int) -> bool:
        self.fenced.append(job)
        return True

    def submit(self, arena: object, slot: int, *a: object) -> object:
        self.submitted.append(slot)
        return "job"


class _Backend:
    cuda = None
    device_staging = 0

    def __init__(self) -> None:
        self.engine = _Engine()

    def hung(self) -> bool:
        return False


def _copier(keeper: object = None):
    from cudasnap.core.copier import Copier
    from cudasnap.core.counters import Counters

    be = _Backend()
    return Copier(None, be, None, keeper, Counters(), wait_timeout_s=30.0,  # type: ignore[arg-type]
                  cadence=None), be.engine  # type: ignore[arg-type]


class _Job:
    step = 7


def test_a_writer_waiting_for_the_live_copy_fences_the_job_that_copy_submitted() -> None:
    """A writer that found a copy of the live state running waits for it, then fences
    the job it submitted (read after the wait): the copy may outlast its flush's timeout,
    and the writer must not write the tensors under it."""
    copier, engine = _copier()
    entered = threading.Event()
    mark = copier.live.mark_dirty
    copier.live.mark_dirty = lambda: (entered.set(), mark())[1]  # type: ignore[method-assign]
    live = copier.live
    live.boundary_starts()
    live.record(7, b"s")
    with live.claim() as got:
        assert got is not None
        writer = threading.Thread(target=copier.fence, args=(1,))
        writer.start()
        assert entered.wait(10)
        writer.join(0.2)
        assert writer.is_alive()  # held by the running copy of the live state
        job = _Job()
        copier.job, copier.fenced = job, [False, False]  # what submit() does
    writer.join(10)
    assert not writer.is_alive() and engine.fenced == [job]


class _Arena:
    meta_capacity = 1 << 20

    def pick_write_slot(self) -> int:
        return 1


class _Keeper:
    arena = None

    def ensure(self, plan: object, n: int, step: int) -> _Arena:
        return _Arena()


class _Lay:
    prefix_len, arena_ok, plan, prefix, total_bytes = 10, None, "plan", b"", 0


def test_a_live_copy_whose_state_moved_meanwhile_is_never_handed_to_the_engine() -> None:
    copier, engine = _copier(_Keeper())  # (the part submit() asks for an arena)
    assert copier.submit(_Lay(), 7, b"s", still_clean=lambda: False) is None  # type: ignore[arg-type]
    assert engine.submitted == []
