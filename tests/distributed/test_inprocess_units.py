"""The membership logic of cudasnap.distributed.inprocess without processes to kill: heartbeats
written by hand into a real control store (a TCPStore), the monitor held still
(``heartbeat_s`` large), each decision called directly."""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import parts

from cudasnap.distributed.inprocess import Attempt, InProcessRestart, NoSpare, PeerLost


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    yield s


def _ipr(store: dist.TCPStore, uid: int, world: int, nproc: int | None = None,
         **kw: object) -> InProcessRestart:
    os.environ.pop("CUDASNAP_NPROC", None)
    ipr = InProcessRestart(control=f"127.0.0.1:{store.port}", uid=uid, world=world,
                           heartbeat_s=3600, **kw)  # type: ignore[arg-type]
    ipr.nproc = nproc or world
    return ipr


def _beat(store: dist.TCPStore, uid: int, age_s: float = 0.0, pid: int | None = None,
          node: str = "elsewhere", ready: bool = True) -> None:
    store.set(f"hb/{uid}", f"{time.time() - age_s},{pid or os.getpid()},{node},{int(ready)}")


def test_a_stale_member_is_replaced_in_its_rank_by_a_ready_spare(store: dist.TCPStore) -> None:
    ipr = _ipr(store, 0, 3, nproc=5)
    try:
        _beat(store, 1)
        _beat(store, 2, age_s=5)  # stale: lost
        _beat(store, 3, ready=False)  # a spare still starting: not taken
        _beat(store, 4)
        assert parts.inprocess_propose(ipr, 0, store)
        assert ipr.generation() == 1 and ipr.members(1) == [0, 1, 4]
        assert not parts.inprocess_propose(ipr, 1, store)  # nobody dead in generation 1
    finally:
        ipr.close()


def test_a_spare_still_starting_is_waited_for_within_its_bound(store: dist.TCPStore) -> None:
    """A rank lost before the spare finished starting (torch still importing: alive, not yet
    waiting for a rank) is taken by it once it is ready, not turned into a full restart;
    a spare that stays not ready past ``spare_start_s`` is no spare (found by the full
    suite: a kill 0.1 s after start, the spare not yet up, made the job restart)."""
    ipr = _ipr(store, 0, 2, nproc=3, spare_start_s=0.6)
    try:
        _beat(store, 1, age_s=5)  # lost
        _beat(store, 2, ready=False)  # the spare, still starting
        assert not parts.inprocess_propose(ipr, 0, store)
        assert ipr.failed() is None and ipr.generation() == 0  # waiting, not failed
        _beat(store, 2)  # the spare is up and waits for a rank
        assert parts.inprocess_propose(ipr, 0, store)
        assert ipr.generation() == 1 and ipr.members(1) == [0, 2]
        _beat(store, 2, age_s=5)  # generation 1 loses the spare; uid 1 is long gone
        store.set("hb/1", f"{time.time()},{os.getpid()},elsewhere,0")  # "starting" again
        assert not parts.inprocess_propose(ipr, 1, store) and ipr.failed() is None
        time.sleep(0.7)  # past spare_start_s: the one still "starting" is no spare
        assert not parts.inprocess_propose(ipr, 1, store)
        assert "full restart" in (ipr.failed() or "")
    finally:
        ipr.close()


def test_a_dead_pid_on_this_node_is_seen_at_once_and_only_there(store: dist.TCPStore) -> None:
    ipr = _ipr(store, 0, 2)
    try:
        gone = 2 ** 22 + 12345  # above pid_max's default: no such process
        _beat(store, 1, pid=gone, node="on,a,node,with,commas")  # another node: pid not looked at
        assert parts.inprocess_alive(ipr, 1, store, time.time())
        _beat(store, 1, pid=gone, node=ipr.node)
        assert not parts.inprocess_alive(ipr, 1, store, time.time())
    finally:
        ipr.close()


def test_no_spare_left_fails_the_job_loudly_on_ranks_and_spares(store: dist.TCPStore) -> None:
    ipr = _ipr(store, 0, 2)
    spare = _ipr(store, 2, 2, nproc=3)
    try:
        _beat(store, 1, age_s=5)
        _beat(store, 2, ready=False)  # alive, but not waiting for a rank
        assert not parts.inprocess_propose(ipr, 0, store)
        why = ipr.failed()
        assert why is not None and "rank(s) [1]" in why and "full restart" in why
        with pytest.raises(NoSpare, match="full restart"):
            next(spare.attempts())  # a waiting spare leaves, with the reason
        att = Attempt(0, 0, 2, [0, 1], ipr)
        with pytest.raises(NoSpare, match=r"rank\(s\) \[1\]"), att:
            raise RuntimeError("Connection reset by peer")  # gloo's, on the survivor
    finally:
        spare.close()
        ipr.close()


def test_a_member_that_neither_joins_nor_dies_is_a_hang_named_within_the_timeout(
        store: dist.TCPStore) -> None:
    ipr = _ipr(store, 0, 2, pg_timeout_s=1.0)
    try:
        _beat(store, 1)  # alive and beating, never joins generation 0
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] neither joined"):
            parts.inprocess_joined(ipr, 0, [0, 1])
        assert time.monotonic() - t0 < 5
    finally:
        ipr.close()


def test_a_generation_that_moves_on_before_it_formed_is_left(store: dist.TCPStore) -> None:
    ipr = _ipr(store, 0, 2, pg_timeout_s=30.0)
    try:
        store.set("members/1", "[0, 2]")
        store.set("gen", "1")  # a proposal by another member: uid 1 was lost
        t0 = time.monotonic()
        assert parts.inprocess_joined(ipr, 0, [0, 1]) is False
        assert time.monotonic() - t0 < 5
        att_gen = 0
        ipr.seen_gen = 1
        with pytest.raises(PeerLost):
            Attempt(att_gen, 0, 2, [0, 1], ipr).check()
    finally:
        ipr.close()


class _Group:
    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def test_nccl_groups_are_aborted_once_when_the_generation_moves_on(
        store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The release of a training thread waiting in an NCCL collective (no GPU here: the
    groups are stand-ins; which groups are NCCL's is tested below on a real gloo group)."""
    from cudasnap.distributed import inprocess

    g = _Group()
    monkeypatch.setattr(inprocess, "nccl_groups", lambda: [g])
    ipr = _ipr(store, 0, 2)
    try:
        parts.inprocess_release(ipr, 0)
        assert g.aborts == 0  # not in an attempt
        parts.set_inprocess_attempt(ipr, 0)
        parts.inprocess_release(ipr, 0)
        assert g.aborts == 0  # the attempt's own generation
        parts.inprocess_release(ipr, 1)
        parts.inprocess_release(ipr, 1)
        assert g.aborts == 1  # once per generation left
    finally:
        ipr.close()


def test_a_gloo_group_is_neither_nccl_nor_aborted_and_is_dropped(tmp_path: Path) -> None:
    from cudasnap.distributed.groups import drop_groups, nccl_groups

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "fs"), 1), rank=0,
                            world_size=1)
    try:
        assert nccl_groups() == []
        kept = drop_groups()
        assert len(kept) == 1 and not dist.is_initialized()
        # the next group is named as a spare's first one is: the names key the store
        assert dist.distributed_c10d._world.group_count == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_late_beat_on_this_node_is_not_a_loss_but_on_another_it_is(
        store: dist.TCPStore) -> None:
    """On this node the pid decides (a process too busy to beat stays a member); elsewhere a
    stale beat is a loss unless its launcher still beats for it."""
    ipr = _ipr(store, 0, 2)
    try:
        _beat(store, 1, age_s=60, node=ipr.node)
        assert parts.inprocess_alive(ipr, 1, store, time.time())
        _beat(store, 1, age_s=60, node="other")
        assert not parts.inprocess_alive(ipr, 1, store, time.time())
        store.set("lhb/1", str(time.time()))
        assert parts.inprocess_alive(ipr, 1, store, time.time())
        store.set("gone/1", "-9")  # its launcher saw it end
        assert not parts.inprocess_alive(ipr, 1, store, time.time())
    finally:
        ipr.close()
