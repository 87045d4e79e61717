"""``objdir:///path``: the backend added as one module and one registry line (issue 47).

A directory written as an object store (storage/object_dir.py): nothing is renamed, the COMMIT
object comes last, a reader lists committed steps only. Covered here: one rank flushes and
a new Snapshotter restores bit for bit while every rename and replace under the directory
fails (the commit must not need one); a Storage made by the caller is the one the
Snapshotter uses; ``cudasnap verify``/``inspect`` read it; a relative path is refused; two
ranks (separate processes, gloo) flush and restore bit for bit through the rank-aware half of
the protocol (``write_rank``/``present``/``commit``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tools.faults.trainlib import train

pytest.importorskip("fsspec")

from helpers import s3_ranks  # noqa: E402

import cudasnap  # noqa: E402
from cudasnap.config import Settings  # noqa: E402
from cudasnap.errors import ConfigError  # noqa: E402
from cudasnap.storage import registry  # noqa: E402
from cudasnap.tools import cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def objdir(snap_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    monkeypatch.setenv("CUDASNAP_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "bucket-mount" / "run1"
    return f"objdir://{root}", root


def small_job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def state_of(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def _no_rename_under(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.rename/os.replace of a path under ``root`` raise (and are recorded)."""
    tried: list[str] = []
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def refuse(src, dst, *a, _real=real, **k):
            if str(root) in os.fspath(src) or str(root) in os.fspath(dst):
                tried.append(os.fspath(src))
                raise OSError(f"rename refused under {root} (a FUSE mount of a bucket)")
            return _real(src, dst, *a, **k)

        monkeypatch.setattr(os, name, refuse)
    return tried


def test_flush_and_restore_bitwise_without_a_rename(objdir, monkeypatch):
    url, root = objdir
    assert registry.backend_of(url).__name__ == "ObjectDirStorage"
    tried = _no_rename_under(root, monkeypatch)
    with pytest.raises(OSError, match="rename refused"):  # the guard itself works
        os.rename(root.parent / "a", root / "b")
    tried.clear()
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=url, backend="cpu", flush_on_close=False,
                                health=False)
    train(model, opt, snap, 3)
    path = snap.flush()
    want = state_of(model, opt)
    snap.close()  # removes the arena: the restore below can only come from the directory
    assert str(path) == f"{url}/step-00000002", path
    for name in ("data.bin", "manifest.json", "COMMIT"):
        assert (root / "step-00000002" / name).is_file(), name
    assert (root / "latest").read_bytes() == b"step-00000002\n"
    assert not [p for p in root.rglob("*") if ".tmp" in p.name or ".writer-" in p.name]
    modes = {p.name: p.stat().st_mode & 0o777 for p in root.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o600} and root.stat().st_mode & 0o777 == 0o700, modes
    assert tried == [], tried  # nothing needed a rename under the directory

    model2, opt2 = small_job(seed=1)
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=url, backend="cpu",
                                 flush_on_close=False, health=False)
    try:
        assert snap2.restore_latest() == 3
        r = snap2.stats()["restore"]
        assert r["source"] == "disk" and r["where"] == f"{url}/step-00000002", r
        got = state_of(model2, opt2)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        snap2.close()


def test_a_storage_passed_in_is_the_one_used(objdir):
    url, root = objdir
    store = registry.open_storage(url, Settings.from_env())
    assert registry.open_storage(store, Settings.from_env()) is store
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=store, backend="cpu",
                                flush_on_close=False, health=False)
    try:
        assert snap.storage is store and snap.directory == store.local_dir
        train(model, opt, snap, 2)
        assert snap.flush() is not None and store.has_step(1)
    finally:
        snap.close()
    assert (root / "step-00000001" / "COMMIT").is_file()


def test_verify_and_inspect_read_it(objdir, capsys):
    url, root = objdir
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=url, backend="cpu", flush_on_close=False,
                                health=False)
    try:
        train(model, opt, snap, 2)
        snap.flush()
    finally:
        snap.close()
    capsys.readouterr()
    assert cli.main(["verify", url]) == 0
    assert "step 1: ok" in capsys.readouterr().out
    assert cli.main(["inspect", url]) == 0
    assert f"{url}/step-00000001" in capsys.readouterr().out
    data = root / "step-00000001" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli.main(["verify", url]) == 1
    assert "step 1: FAILED" in capsys.readouterr().out


def test_a_relative_path_is_refused(objdir):
    with pytest.raises(ConfigError, match="absolute path"):
        registry.open_storage("objdir://relative/run", Settings.from_env())


def _ranks(scenario: str, url: str, base: Path) -> list[int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDASNAP_PEER_TIMEOUT_S": "30",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return s3_ranks.launch(scenario, url, base, env)


_logs = s3_ranks.logs_of


@pytest.mark.slow
def test_two_ranks_commit_and_restore_bitwise(objdir, snap_env, tmp_path):
    url, root = objdir
    base = tmp_path / "job"
    base.mkdir()
    assert _ranks("save", url, base) == [0, 0], _logs("save", base)
    for step in (3, 5):
        commit = json.loads((root / f"step-{step:08d}" / "COMMIT").read_text())
        assert commit["world_size"] == 2 and commit["present"] == [0, 1], commit
    assert (root / "latest").read_bytes() == b"step-00000005\n"
    for arena in snap_env.arena_files():  # the restore below can only come from the directory
        arena.unlink()
    assert _ranks("restore", url, base) == [0, 0], _logs("restore", base)
    for r in (0, 1):
        res = json.loads((base / f"restore-rank-{r}.json").read_text())
        assert res["start"] == 6 and res["restore"]["source"] == "disk", res
        with np.load(base / f"save-rank-{r}-step5.npz") as a, \
                np.load(base / f"restore-rank-{r}.npz") as b:
            assert a.files == b.files and all(a[k].tobytes() == b[k].tobytes() for k in a.files)
