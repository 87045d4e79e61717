"""Issue 44 item 1: ``close()`` never destroys the only copy of a job's newest state.

A peer's death makes gloo raise on the survivors; torchtitan's ``main()`` (and many trainers)
then call ``close()`` inside ``except``. Before this fix a distributed ``close()`` removed its
arena there, and the restart could assemble no step: the job started over at step 0. Each
case runs tools/dist/close_worker.py on 2 ranks (gloo, CPU) under torchrun."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.dist import launch

SCRIPT = Path(launch.__file__).with_name("close_worker.py")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("end", "kept"), [("peer_error", True), ("no_flush", True),
                                           ("flushed", False), ("discard", False)])
def test_close_keeps_the_arena_unless_the_state_is_committed_or_discarded(
        tmp_path: Path, end: str, kept: bool) -> None:
    r = launch.run(tmp_path, nproc=2, max_restarts=0, script=SCRIPT, timeout=180,
                   env={"END": end, "CUDASNAP_HEALTH": "0"})
    try:
        log = f"rc={r.rc}\n{launch.log_tail(r, 60)}"
        assert r.rc == 0, log
        assert sorted(r.ranks) == [0, 1], log
        for rank, info in r.ranks.items():
            assert info["exists"] is kept, (rank, info, log)
        if end == "peer_error":
            assert "closes during RuntimeError" in r.log and "keeps the staging arena" in r.log
        if end == "no_flush":
            assert "not committed" in r.log and "keeps the staging arena" in r.log
    finally:
        launch.cleanup_arenas(r.job)
