"""Snapshots in an object store (``s3://``) through cudasnap.storage.fsspec.

Every test talks HTTP to a real S3-compatible server started here on 127.0.0.1
(moto's standalone server, ``python -m moto.server``, in its own process); the
endpoint is forced through CUDASNAP_S3_ENDPOINT and the credentials are dummies,
so nothing ever reaches AWS. Covered: flush + bitwise restore, a flush killed
mid-upload (and after the manifest, before COMMIT) leaves the previous snapshot
loadable, a corrupted object is skipped with a warning naming it, and
``cudasnap verify`` / ``cudasnap inspect`` on the URL.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from tools.faults.trainlib import train

s3fs = pytest.importorskip("s3fs", reason="s3fs not installed (pip install 'cudasnap[s3]')")
pytest.importorskip("moto.server", reason="moto[server] not installed (requirements-dev.txt)")

import cudasnap  # noqa: E402
from cudasnap.tools import cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start (see {log.name})")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture
def s3(s3_server, snap_env, monkeypatch, tmp_path):
    """A URL in a fresh (created) bucket on the local server; AWS settings that can reach nothing else."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "CUDASNAP_S3_ENDPOINT": s3_server,
           "CUDASNAP_STATE_DIR": str(tmp_path / "state")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    url = f"s3://cs-{uuid.uuid4().hex[:12]}/run1"
    _fs().mkdir(url.removeprefix("s3://").split("/")[0])  # cudasnap never creates buckets
    return url


def _fs():
    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["CUDASNAP_S3_ENDPOINT"]},
                             skip_instance_cache=True)


def small_job(seed: int = 0, dim: int = 48):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(),
                                torch.nn.Linear(dim, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def state_of(model, opt):
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


@pytest.mark.slow
def test_flush_then_restore_from_s3_is_bitwise(s3):
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", flush_on_close=False)
    train(model, opt, snap, 3)
    path = snap.flush()
    want = state_of(model, opt)
    snap.close()  # removes the arena: the restore below can only come from S3
    key = s3.removeprefix("s3://")
    fs = _fs()
    assert str(path) == f"{s3}/step-00000002"
    for name in ("data.bin", "manifest.json", "COMMIT"):
        assert fs.exists(f"{key}/step-00000002/{name}"), name
    assert fs.cat_file(f"{key}/latest") == b"step-00000002\n"

    model2, opt2 = small_job(seed=1)
    assert not torch.equal(model2[0].weight, model[0].weight)
    snap2 = cudasnap.Snapshotter(model2, opt2, directory=s3, backend="cpu", flush_on_close=False)
    try:
        assert snap2.restore_latest() == 3
        r = snap2.stats()["restore"]
        assert r["source"] == "disk" and r["where"] == f"{s3}/step-00000002", r
        got = state_of(model2, opt2)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        snap2.close()


CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]  # test_s3, tests/ (helpers)
    from test_s3 import small_job, train
    import cudasnap
    import cudasnap._testing.faults  # the kill points; armed below through the variable
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=sys.argv[1], backend="cpu",
                                flush_on_close=False)
    train(model, opt, snap, 2)
    snap.flush()                                   # step 1: committed
    os.environ["CUDASNAP_TEST_KILL_AT"] = sys.argv[3]
    train(model, opt, snap, 2, start=2)
    snap.flush()                                   # step 3: killed part-way
    print("NOT KILLED", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["upload", "manifest"])
def test_flush_killed_mid_upload_leaves_previous_snapshot_loadable(s3, snap_env, phase):
    """SIGKILL while uploading the data object (or after the manifest, before COMMIT): the
    torn step is never loaded; the next Snapshotter removes it and restores step 1."""
    p = subprocess.run([sys.executable, "-c", CHILD, s3, str(Path(__file__).parent), phase],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1",
                            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr[-3000:])
    key = s3.removeprefix("s3://")
    fs = _fs()
    assert fs.exists(f"{key}/step-00000001/COMMIT")
    assert not fs.exists(f"{key}/step-00000003/COMMIT")
    if phase == "manifest":  # data and manifest are there: only COMMIT is missing
        assert fs.exists(f"{key}/step-00000003/manifest.json")
    for arena in snap_env.arena_files():  # its shm copy of step 3 is fine: test the store only
        arena.unlink()
    model, opt = small_job(seed=2)
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", flush_on_close=False)
    try:
        assert not _fs().exists(f"{key}/step-00000003/manifest.json")  # cleaned at start
        assert snap.restore_latest() == 2
        assert snap.stats()["restore"]["where"] == f"{s3}/step-00000001"
    finally:
        snap.close()


def _two_flushes(s3):
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", flush_on_close=False)
    train(model, opt, snap, 2)
    snap.flush()
    train(model, opt, snap, 2, start=2)
    snap.flush()
    snap.close()


def _flip(fs, key):
    raw = bytearray(fs.cat_file(key))
    raw[len(raw) // 2] ^= 0x10
    fs.pipe_file(key, bytes(raw))


def test_corrupted_object_is_skipped_with_a_warning_naming_it(s3, caplog):
    _two_flushes(s3)
    key = s3.removeprefix("s3://")
    _flip(_fs(), f"{key}/step-00000003/data.bin")
    model, opt = small_job(seed=3)
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", flush_on_close=False)
    try:
        with caplog.at_level(logging.WARNING):
            assert snap.restore_latest() == 2  # step 1, the older one
        assert f"{s3}/step-00000003/data.bin" in caplog.text and "CRC32C" in caplog.text
    finally:
        snap.close()


def test_corrupted_manifest_is_skipped(s3, caplog):
    _two_flushes(s3)
    key = s3.removeprefix("s3://")
    _flip(_fs(), f"{key}/step-00000003/manifest.json")
    model, opt = small_job(seed=3)
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", flush_on_close=False)
    try:
        with caplog.at_level(logging.WARNING):
            assert snap.restore_latest() == 2
        assert f"{s3}/step-00000003/manifest.json" in caplog.text
    finally:
        snap.close()


def test_cli_verify_and_inspect_on_an_s3_url(s3, capsys):
    _two_flushes(s3)
    capsys.readouterr()
    assert cli.main(["verify", s3]) == 0
    out = capsys.readouterr().out
    assert "step 3: ok" in out and "step 1: ok" in out
    assert cli.main(["inspect", s3, "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{s3}/step-00000003" in out and "(latest)" in out and " ok " in out
    _flip(_fs(), f"{s3.removeprefix('s3://')}/step-00000003/data.bin")
    assert cli.main(["verify", s3]) == 1
    out = capsys.readouterr().out
    assert "step 3: FAILED" in out and f"{s3}/step-00000003/data.bin" in out
    assert "step 1: ok" in out
    assert cli.main(["verify", s3, "--step", "7"]) == 2


def test_fresh_on_a_url_is_refused_clearly(s3):
    """fresh=True cannot move object-store snapshots aside (no rename): refused, naming a
    new prefix as the way to start fresh; a multi-rank world size is no longer refused."""
    from cudasnap.errors import ConfigError

    model, opt = small_job()
    with pytest.raises(ConfigError, match="fresh=True.*new URL prefix"):
        cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", fresh=True)
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", rank=0, world_size=2,
                                distributed=False, flush_on_close=False)
    snap.close()
