"""The agreed restore with a different ``job=`` per rank by mistake (issue 23 item 6).

Store keys are namespaced by job, so such ranks never meet: before, each waited the
whole restore timeout (300 s) without a word. Now each publishes its job outside the
namespace and fails at once with a ConfigError naming both jobs; a rank still waiting
for a peer says so early. Ranks are threads sharing one in-process c10d HashStore.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from cudasnap.distributed import restore_vote  # noqa: E402
from cudasnap.distributed.kv import KV  # noqa: E402
from cudasnap.distributed.restore_vote import RestoreVote  # noqa: E402
from cudasnap.errors import ConfigError, SnapshotError  # noqa: E402

GUARD_S = 120.0  # the restore timeout: a failure guard, never reached when things work


class _Local:
    """What RestoreVote reads of a rank's LocalSnapshots before any step is tried."""

    def __init__(self, rank: int, world: int, job: str, directory: Path) -> None:
        self.rank, self.world_size, self.job, self.directory = rank, world, job, directory

    def arenas(self) -> list[Any]:
        return []


def _vote(store: Any, rank: int, world: int, job: str, directory: Path,
          timeout_s: float = GUARD_S) -> RestoreVote:
    kv = KV(f"cudasnap/{job}/e0/", store=store, monitor_store=store)
    return RestoreVote(kv, _Local(rank, world, job, directory), lambda *a, **k: None,
                       replica_groups=[list(range(world))], timeout_s=timeout_s)


def _run_ranks(votes: list[RestoreVote]) -> list[Any]:
    out: list[Any] = [None] * len(votes)

    def go(i: int) -> None:
        try:
            out[i] = votes[i].restore()
        except Exception as e:  # noqa: BLE001 - returned for the assertions
            out[i] = e

    ts = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(votes))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(GUARD_S * 2)
    assert not any(t.is_alive() for t in ts)
    return out


def test_ranks_of_different_jobs_fail_at_once_naming_both(tmp_path):
    store = dist.HashStore()
    # this process already ran a restore on rank 0 alone (its peer never came): the ranks
    # now differ in how many restores they ran, which must not hide the mismatch
    with pytest.raises(SnapshotError):
        _vote(store, 0, 2, "job-0", tmp_path / "earlier", timeout_s=0.2).restore()
    out = _run_ranks([_vote(store, 0, 2, "job-a", tmp_path), _vote(store, 1, 2, "job-b", tmp_path)])
    for r, got in enumerate(out):
        assert isinstance(got, ConfigError), (r, got)
        assert "'job-a'" in str(got) and "'job-b'" in str(got) and "same job=" in str(got)


def test_ranks_of_one_job_still_agree(tmp_path):
    store = dist.HashStore()
    out = _run_ranks([_vote(store, r, 2, "job-a", tmp_path) for r in range(2)])
    assert out == [0, 0]  # nothing loadable: a fresh start on both ranks


def test_a_missing_peer_is_reported_early_then_named_at_the_timeout(tmp_path, monkeypatch,
                                                                   caplog):
    monkeypatch.setattr(restore_vote, "WAIT_WARN_S", 0.0)
    caplog.set_level(logging.WARNING, logger="cudasnap.distributed")
    vote = _vote(dist.HashStore(), 0, 2, "job-a", tmp_path, timeout_s=0.5)
    with pytest.raises(SnapshotError, match=r"rank\(s\) \[1\] did not take part"):
        vote.restore()
    assert any("waiting" in r.getMessage() and "[1]" in r.getMessage() and "job=" in
               r.getMessage() for r in caplog.records), caplog.text


def test_one_group_restoring_job_a_then_job_b_is_not_a_mismatch(tmp_path):
    """Consecutive restores of two jobs in one process group (a script that trains two
    models, or the fault matrix's cases): rank 0 starting B's restore while rank 1 is still
    on A's must wait for rank 1, not read its job key of A and fail."""
    store = dist.HashStore()
    first = _run_ranks([_vote(store, r, 2, "job-a", tmp_path / "a") for r in range(2)])
    assert first == [0, 0]
    # rank 0 alone starts job B's restore; rank 1 joins it only after a pause
    votes = [_vote(store, r, 2, "job-b", tmp_path / "b") for r in range(2)]
    out: list[Any] = [None, None]

    def go(i: int) -> None:
        try:
            out[i] = votes[i].restore()
        except Exception as e:  # noqa: BLE001
            out[i] = e

    t0 = threading.Thread(target=go, args=(0,), daemon=True)
    t0.start()
    t0.join(0.5)
    assert t0.is_alive(), out[0]  # waiting for rank 1, not failed on its stale job key
    go(1)
    t0.join(GUARD_S)
    assert out == [0, 0]
