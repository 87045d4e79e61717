"""Typed storage and dist boundaries (issue 12): bugs the typing of slot info, flush stats,
snapshot refs and COMMIT records brought out, each reproduced here.

* ``posix.write_slot`` of a step already on disk returned stats without ``step``; the
  Snapshotter's flush reads ``st["step"]``: a second ``flush()`` of the same snapshot
  raised KeyError.
* A storage handed another backend's snapshot ref (a local one to the object store, a
  remote one to the local disk) failed with AttributeError / a misleading "cannot read"
  CorruptSnapshot (which restore skips silently); now a ConfigError naming the ref.
* The agreed restore read a slot's manifest with ``json.loads(...).get``: a slot holding
  CRC-valid JSON that is not an object raised AttributeError instead of CorruptSnapshot
  (which makes the vote try an older step).
* A COMMIT record's ``replica_groups`` is untrusted JSON: a non-list raised TypeError
  from ``len()`` instead of the IncompatibleSnapshot naming the world sizes.
* ``replicas=`` that is not "auto"/"all"/"none" or rank groups raised a raw
  TypeError/ValueError from ``int()``; now a ConfigError naming the value.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import parts

import cudasnap
from cudasnap.config import Settings
from cudasnap.distributed.restore_vote import RestoreVote
from cudasnap.errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot
from cudasnap.storage import PosixStorage, posix
from tools.faults.trainlib import train


def small_job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_second_flush_of_the_same_snapshot_returns_its_path(snap_env):
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, backend="cpu",
                                flush_on_close=False)
    try:
        train(model, opt, snap, 2)
        first = snap.flush()
        again = snap.flush()  # the slot is already on disk: skipped, same place
        assert first is not None and again == first
        arena = snap.staged_arenas()[0]
        slot = arena.newest_complete()
        arena.lease(slot)
        try:
            _, st = posix.write_slot(arena, slot, snap_env.dir)
        finally:
            arena.release(slot)
        assert st.get("skipped") and st["step"] == 1 and st["bytes"] == 0
    finally:
        snap.close()


def test_a_storage_refuses_another_backends_snapshot_clearly(tmp_path, monkeypatch):
    pytest.importorskip("fsspec")
    from cudasnap.storage.fsspec import FsspecStorage
    from cudasnap.storage.remote_base import RemoteSnapshot

    local = PosixStorage(tmp_path / "d")
    remote = RemoteSnapshot(3, "memory://elsewhere/step-00000003")
    with pytest.raises(ConfigError, match="memory://elsewhere/step-00000003 is not a local"):
        local.load_manifest(remote)
    monkeypatch.setenv("CUDASNAP_STATE_DIR", str(tmp_path / "state"))
    store = FsspecStorage("memory://typ-test/run", Settings.from_env())
    on_disk = posix.StoredSnapshot(3, tmp_path / "d" / "step-00000003")
    for call in (lambda: store.load_manifest(on_disk),
                 lambda: store.read_data(on_disk, {"data": {"bytes": 0}})):  # type: ignore[typeddict-item]
        with pytest.raises(ConfigError, match="is not a snapshot of memory://typ-test/run"):
            call()
    other = RemoteSnapshot(3, "s3://typ-test/run/step-00000003")  # another protocol
    with pytest.raises(ConfigError, match="not a snapshot of"):
        store.load_manifest(other)


class _Local:
    """The two LocalSnapshots members _restore_step / _check_world use."""

    def __init__(self, arenas):
        self._arenas = arenas
        self.rank, self.world_size = 0, 2

    def arenas(self):
        return self._arenas

    def restore_from_slot(self, arena, slot, where):  # pragma: no cover - must not be reached
        raise AssertionError("a slot with a non-object manifest was applied")


def _vote(arenas=()):
    return RestoreVote(None, _Local(list(arenas)), None,  # type: ignore[arg-type]
                       replica_groups=[[0, 1]], timeout_s=1.0)


def test_restore_vote_refuses_a_slot_whose_manifest_is_not_an_object(native_C, snap_env):
    path = Path("/dev/shm") / f"cudasnap-{snap_env.job}-typ"
    arena = native_C.Arena.create(str(path), 2, 1 << 16, 1 << 12, 4096, snap_env.job)
    try:
        arena.begin_write(0, 7, b"[1, 2]")  # CRC-consistent JSON, not an object
        arena.commit(0, 7, 0)
        assert arena.slot_info(0)["valid"]
        with pytest.raises(CorruptSnapshot, match="not a JSON object"):
            parts.vote_restore_step(_vote([arena]), 7, True, None)
    finally:
        arena.unlink()


@pytest.mark.parametrize("groups", [7, "0,1", {"a": 1}, None, [[0], [1]]])
def test_world_change_with_a_malformed_commit_record_is_incompatible(groups):
    with pytest.raises(IncompatibleSnapshot, match="saved by 4 ranks, this job has 2"):
        parts.vote_check_world(_vote(), 5, 4, groups, "DIR/step-00000005")
    parts.vote_check_world(_vote(), 5, 4, [[0, 1, 2, 3]], "DIR")  # replicated then and now: fine


@pytest.mark.parametrize("bad", ["bogus", 5, [[0, "x"], [1]], [0, 1], [[0.0], [1]]])
def test_malformed_replicas_are_a_config_error_naming_them(bad):
    from cudasnap.distributed.coordinator import replica_groups

    with pytest.raises(ConfigError, match=r"replicas=.*expected 'auto', 'all', 'none' or a list"):
        replica_groups(bad, 2, False)
    assert replica_groups([[1, 0]], 2, False) == [[0, 1]]
    assert replica_groups("none", 2, True) == [[0], [1]]


def test_has_step_asks_the_storage_itself_never_a_local_path(tmp_path, monkeypatch):
    """Issue 36: "is this step on disk" was a local listing, also for an object store
    (a regrown arena's snapshot then looked stored when a local folder of that name
    existed, and never did otherwise). Now the storage's own ``has_step``."""
    pytest.importorskip("fsspec")
    from cudasnap.storage.fsspec import FsspecStorage

    monkeypatch.setenv("CUDASNAP_STATE_DIR", str(tmp_path / "state"))
    model, opt = small_job()
    url = f"memory://has-step-{tmp_path.name}/run"
    for directory in (tmp_path / "d", url):
        snap = cudasnap.Snapshotter(model, opt, directory=directory, backend="cpu",
                                    flush_on_close=False, health=False)
        try:
            train(model, opt, snap, 2)
            assert snap.flush() is not None
            store = snap.storage
            assert store.has_step(1) and not store.has_step(0) and not store.has_step(2)
        finally:
            snap.close()
    remote = FsspecStorage(url, Settings.from_env())
    fake = remote.local_dir / "step-00000007"  # a local folder of a step's name
    fake.mkdir(parents=True)
    (fake / "manifest.json").write_text("{}")
    assert not remote.has_step(7) and remote.has_step(1)
    assert remote.read_ahead(remote.list_snapshots()[0]) is None
