"""Multi-rank jobs and ``cudasnap run`` on an object-store URL (issue 25 item 4).

The S3 server is test_s3.py's (moto's standalone server on 127.0.0.1, dummy credentials,
nothing reaches AWS). Ranks are separate processes (tests/helpers/s3_ranks.py, gloo on
CPU, a FileStore), as torchrun would start them. Covered: two ranks flush to the store
(each its part, one COMMIT, ``latest`` moved) and a new two-rank job restores both ranks
bit for bit from it; a rank SIGKILLed while uploading its part leaves the step
uncommitted and the previous one is what both ranks load; ``cudasnap run --dir s3://``
flushes a killed child's arena to the store and the restarted child resumes from the
store bit for bit.
"""
# ruff: noqa: F811  (the fixtures imported from test_s3 are parameters here)
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

s3fs = pytest.importorskip("s3fs", reason="s3fs not installed (pip install 'cudasnap[s3]')")
pytest.importorskip("moto.server", reason="moto[server] not installed (requirements-dev.txt)")

from helpers import parts, s3_ranks  # noqa: E402
from test_s3 import REPO, _fs, s3, s3_server  # noqa: E402,F401 - fixtures

from cudasnap.config import Settings  # noqa: E402
from cudasnap.tools import cli  # noqa: E402

TIMEOUT_S = 420  # two torch imports and a job on a shared 2-core machine


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDASNAP_PEER_TIMEOUT_S": "30",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _ranks(scenario: str, url: str, base: Path, world: int = 2) -> list[int]:
    """Runs every rank of ``scenario`` to its end; their exit codes."""
    return s3_ranks.launch(scenario, url, base, _env(), world, TIMEOUT_S)


_logs = s3_ranks.logs_of


def _result(scenario: str, base: Path, rank: int) -> dict:
    return json.loads((base / f"{scenario}-rank-{rank}.json").read_text())


def _state(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.slow
def test_two_ranks_flush_to_s3_and_both_restore_bitwise(s3, snap_env, tmp_path, capsys):
    base = tmp_path / "job"
    base.mkdir()
    rcs = _ranks("save", s3, base)
    assert rcs == [0, 0], _logs("save", base)
    key = s3.removeprefix("s3://")
    fs = _fs()
    for step in (3, 5):
        commit = json.loads(fs.cat_file(f"{key}/step-{step:08d}/COMMIT"))
        assert commit["world_size"] == 2 and commit["present"] == [0, 1], commit
        for r in (0, 1):
            for name in ("data.bin", "manifest.json"):
                assert fs.exists(f"{key}/step-{step:08d}/rank-{r:05d}/{name}"), (step, r, name)
    assert fs.cat_file(f"{key}/latest") == b"step-00000005\n"
    assert not [k for k in fs.find(key) if "/.writer-" in k], "a writer marker was left"
    assert cli.main(["verify", s3]) == 0
    out = capsys.readouterr().out
    assert "step 5: ok" in out and "2 ranks" in out, out
    for arena in snap_env.arena_files():  # the restore below can only come from S3
        arena.unlink()

    rcs = _ranks("restore", s3, base)
    assert rcs == [0, 0], _logs("restore", base)
    for r in (0, 1):
        res = _result("restore", base, r)
        assert res["start"] == 6, res
        assert res["restore"]["source"] == "disk", res
        assert _bitwise(_state(base / f"restore-rank-{r}.npz"),
                        _state(base / f"save-rank-{r}-step5.npz")), f"rank {r} differs"
    # the two ranks trained on different data: each loaded its own part
    assert not _bitwise(_state(base / "restore-rank-0.npz"), _state(base / "restore-rank-1.npz"))


@pytest.mark.slow
def test_a_rank_killed_mid_upload_is_rewritten_by_the_next_round(s3, snap_env, tmp_path):
    """Rank 1 is SIGKILLed inside its upload of step 5: that round does not commit; the
    next one (rank 1 now dead) rewrites rank 1's part from the arena it left on this host
    over the torn upload and commits step 5; a new job loads step 5 from the store."""
    base = tmp_path / "job"
    base.mkdir()
    rcs = _ranks("kill", s3, base)
    assert rcs[1] == -9 and rcs[0] == 0, (rcs, _logs("kill", base))
    assert _result("kill", base, 0)["flush5"] != "None", _logs("kill", base)
    logs = _logs("kill", base)
    assert "step 5 NOT committed: rank(s) [1] died during the flush" in logs, logs
    assert "flushed dead rank 1's arena for step 5" in logs, logs
    key = s3.removeprefix("s3://")
    fs = _fs()
    assert fs.exists(f"{key}/step-00000005/COMMIT")
    assert fs.cat_file(f"{key}/latest") == b"step-00000005\n"
    for arena in snap_env.arena_files():  # both arenas hold step 5: test the store only
        arena.unlink()

    rcs = _ranks("restore", s3, base)
    assert rcs == [0, 0], _logs("restore", base)
    for r in (0, 1):
        res = _result("restore", base, r)
        assert res["start"] == 6 and res["restore"]["source"] == "disk", res
    for r in (0, 1):  # rank 1's part: the one rewritten over its torn upload
        assert _bitwise(_state(base / f"restore-rank-{r}.npz"),
                        _state(base / f"kill-rank-{r}-step5.npz")), f"rank {r} differs"


TRAIN = textwrap.dedent("""
    import os, sys, signal, time, json
    import numpy as np, torch, cudasnap
    from pathlib import Path
    out, mode = Path(sys.argv[1]), sys.argv[2]
    attempt = int(os.environ.get("CUDASNAP_RESTART", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "kill" and attempt > 0:
        # Resume from the store, not from shared memory: wait (bounded) until the
        # supervisor has committed the dead attempt's step, then drop the arenas.
        from cudasnap.storage.remote_base import filesystem
        fs, root = filesystem(os.environ["CUDASNAP_DIR"], os.environ["CUDASNAP_S3_ENDPOINT"])
        end = time.monotonic() + 300
        while not fs.exists(f"{root}/step-00000004/COMMIT"):
            assert time.monotonic() < end, "the supervisor never committed step 4"
            time.sleep(0.2)
            fs.invalidate_cache()
        shm = Path(os.environ["CUDASNAP_SHM_DIR"])
        for p in shm.glob("cudasnap-*"):
            if os.environ["CUDASNAP_DIR_JOB"] in p.name:
                p.unlink()
    snap = cudasnap.Snapshotter(model, opt, backend="cpu", **({} if mode == "kill" else
                                {"directory": str(out / "ref")}))
    start = snap.restore_latest()
    info = {k: str(v) for k, v in (snap.stats()["restore"] or {}).items()}
    for step in range(start, 8):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        snap.boundary(step)
        if mode == "kill" and attempt == 0 and step == 4:
            snap.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    snap.close()
    st = {f"m.{k}": v.numpy() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        st.update({f"o.{i}.{k}": v.numpy() for k, v in s.items() if torch.is_tensor(v)})
    np.savez(out / f"{mode}-final.npz", **st)
    (out / f"{mode}-{attempt}.json").write_text(json.dumps({"start": start, "restore": info}))
""")


@pytest.mark.slow
def test_cudasnap_run_on_s3_flushes_the_killed_child_and_resumes_from_the_store(
        s3, snap_env, tmp_path):
    from cudasnap.format import paths
    from cudasnap.storage.remote_base import state_dir

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = _env()
    job = paths.job_for(state_dir(s3, Settings.from_env().state_dir))  # the supervisor derives the job from it
    assert job is not None
    env["CUDASNAP_DIR_JOB"] = job
    try:
        p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", s3,
                            "--max-restarts", "1", "--no-warm", "--", sys.executable,
                            str(script), str(tmp_path), "kill"], env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    finally:
        for a in Path("/dev/shm").glob(f"cudasnap-{job}*"):
            a.unlink(missing_ok=True)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "flushed step 4" in p.stderr, p.stderr[-4000:]
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()
    key = s3.removeprefix("s3://")
    fs = _fs()
    assert fs.exists(f"{key}/step-00000004/COMMIT")  # the supervisor's flush of the dead child
    res = json.loads((tmp_path / "kill-1.json").read_text())
    assert res["start"] == 5, res
    assert res["restore"]["source"] == "disk" and res["restore"]["where"] == \
        f"{s3}/step-00000004", res

    ref = subprocess.run([sys.executable, str(script), str(tmp_path), "ref"], env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert _bitwise(_state(tmp_path / "kill-final.npz"), _state(tmp_path / "ref-final.npz"))


def test_latest_moves_by_compare_and_swap_and_never_back(s3, monkeypatch):
    """``latest`` on S3: created with If-None-Match, never moved back to an older step, and a
    writer that slips in between the read and the write makes the stale If-Match fail (412):
    the pointer is read again, and the newer step it names now stays."""
    from cudasnap.storage.fsspec import FsspecStorage

    st = FsspecStorage(s3, Settings.from_env())
    key = s3.removeprefix("s3://")
    fs = _fs()
    for step in (3, 5):
        fs.pipe_file(f"{key}/step-{step:08d}/COMMIT", b"{}")
    assert st.replace_latest(5) and st.read_latest() == "step-00000005"
    assert not st.replace_latest(3) and st.read_latest() == "step-00000005"
    real, raced = parts.remote_latest_read(), []

    def racing(fs_, k):
        got = real(fs_, k)  # (ETag, pointer) of step 5
        if not raced:  # another writer commits step 9 and moves the pointer meanwhile
            raced.append(k)
            fs.pipe_file(f"{key}/step-00000009/COMMIT", b"{}")
            fs.pipe_file(k, b"step-00000009\n")
        return got

    parts.replace_remote_latest_read(monkeypatch, racing)
    assert not st.replace_latest(7)  # a plain read-compare-write would have put 7 over 9
    assert raced and _fs().cat_file(f"{key}/latest") == b"step-00000009\n"


def test_clean_partial_spares_a_live_writer_and_removes_a_dead_ones(s3):
    """An uncommitted step whose writer marker names a live process on this host (or one on
    another host, recently) is left alone; one whose writer is dead is removed."""
    from cudasnap.storage.fsspec import FsspecStorage

    st = FsspecStorage(s3, Settings.from_env())
    key = s3.removeprefix("s3://")
    fs = _fs()
    host = parts.remote_host()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    try:
        fs.pipe_file(f"{key}/step-00000004/data.bin", b"x")
        fs.pipe_file(f"{key}/step-00000004/.writer-{host}-{live.pid}", b"")
        fs.pipe_file(f"{key}/step-00000006/rank-00001/data.bin", b"x")
        fs.pipe_file(f"{key}/step-00000006/rank-00001/.writer-{host}-{dead}", b"")
        fs.pipe_file(f"{key}/step-00000008/rank-00000/.writer-otherhost-1", b"")
        assert st.clean_partial() == [f"{s3}/step-00000006"]
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(60)
    assert st.clean_partial() == [f"{s3}/step-00000004"]  # its writer has exited now
    fs.invalidate_cache()
    assert fs.exists(f"{key}/step-00000008/rank-00000/.writer-otherhost-1")


def test_supervise_refuses_a_collapsed_url_and_fresh_on_a_url(s3, snap_env, tmp_path,
                                                               monkeypatch):
    """``Path("s3://b/p")`` is ``s3:/b/p``: refused (it would make a local ``./s3:``
    folder); ``--fresh`` on a URL is refused (no rename in an object store)."""
    from cudasnap.errors import ConfigError
    from cudasnap.supervisor.loop import supervise

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="'//' was lost"):
        supervise(["true"], Path(s3), max_restarts=0)
    with pytest.raises(ConfigError, match="--fresh.*new URL prefix"):
        supervise(["true"], s3, max_restarts=0, fresh=True)
    assert not (tmp_path / "s3:").exists()
    assert supervise(["true"], s3, max_restarts=0) == 0  # a URL given whole is supervised


def test_every_host_of_a_url_gets_the_same_directory_id(s3, monkeypatch, tmp_path):
    """A URL's state directory is per host, but the id that names the job (its arenas, the
    c10d keys of its ranks) comes from the store: two hosts (two state directories) agree."""
    from cudasnap.format import paths
    from cudasnap.storage import open_storage

    ids = []
    for host in ("node-a", "node-b"):
        monkeypatch.setenv("CUDASNAP_STATE_DIR", str(tmp_path / host))
        st = open_storage(s3, Settings.from_env())
        ids.append(paths.directory_id(st.local_dir, create=False))
    assert ids[0] is not None and ids[0] == ids[1]
    assert _fs().cat_file(f"{s3.removeprefix('s3://')}/.cudasnap-id").decode().strip() == ids[0]


def test_cli_run_fresh_on_a_url_is_one_clear_line(tmp_path):
    """``cudasnap run --dir s3://... --fresh``: refused before the store is contacted (one
    line, exit 2, no ``./s3:`` folder)."""
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", "s3://bucket/run",
                        "--fresh", "--", "true"], env=_env(), capture_output=True, text=True,
                       cwd=tmp_path, timeout=TIMEOUT_S)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--fresh" in lines[0] and "new URL prefix" in lines[0], p.stderr
    assert not (tmp_path / "s3:").exists()
