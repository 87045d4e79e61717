"""The ``cudasnap`` command line (inspect, verify, export, gc, health, advise, --help) and
transparent mode (``cudasnap run --auto`` on a script with no cudasnap code, then
``cudasnap export``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import parts

from cudasnap._native import native
from cudasnap.snapshotter import Snapshotter
from cudasnap.storage import latest, posix
from cudasnap.tools import cli
from cudasnap.triggers import nvml as _nvml
from tools.faults.layout import flip_byte
from tools.faults.trainlib import train

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ["demo", "run", "inspect", "verify", "export", "gc", "health", "advise"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra)
    return env


def small_job(dim: int = 48):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.BatchNorm1d(dim),
                                torch.nn.ReLU(), torch.nn.Linear(dim, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().out


# ----------------------------------------------------------------------------- --help

def test_help_of_the_command_and_every_subcommand(capsys):
    exe = Path(sys.executable).with_name("cudasnap")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cudasnap"]
    p = subprocess.run([*cmd, "--help"], env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    for sub in SUBCOMMANDS:
        assert sub in p.stdout
    for sub in SUBCOMMANDS:
        capsys.readouterr()
        with pytest.raises(SystemExit) as ei:
            cli.main([sub, "--help"])
        out = capsys.readouterr().out
        assert ei.value.code == 0, sub
        assert "usage:" in out and sub in out, (sub, out)


# ----------------------------------------------------------------------------- inspect

def test_inspect_lists_disk_and_shared_memory_snapshots(snap_env, capsys):
    model, opt = small_job()
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, copy_threads=1)
    try:
        train(model, opt, snap, 1)
        snap.flush()  # step 0 on disk
        train(model, opt, snap, 1, start=1)  # shm: slots with steps 0 and 1
        rc, out = run_cli(capsys, "inspect", snap_env.dir)
        assert rc == 0
        rows = [ln.split() for ln in out.splitlines()[1:]]
        assert ["0", "disk"] in [r[:2] for r in rows], out
        assert ["1", "shm"] in [r[:2] for r in rows] and ["0", "shm"] in [r[:2] for r in rows]
        assert "(latest)" in out and str(snap_env.arena_path()) in out
        rc, out = run_cli(capsys, "inspect", snap_env.dir, "--json")
        assert rc == 0
        got = json.loads(out)
        assert {(r["source"], r["step"]) for r in got} == {("disk", 0), ("shm", 0), ("shm", 1)}
        assert all(r["status"] == ("unverified" if r["source"] == "disk" else "ok")
                   for r in got), got
        rc, out = run_cli(capsys, "inspect", snap_env.dir, "--json", "--verify")
        assert all(r["status"] == "ok" for r in json.loads(out)), out
        disk = [r for r in got if r["source"] == "disk"][0]
        assert disk["latest"] and disk["bytes"] == snap.stats()["bytes"]
    finally:
        snap.close()
    rc, out = run_cli(capsys, "inspect", snap_env.dir, "--json")
    assert {r["source"] for r in json.loads(out)} == {"disk"}  # close() removed the arena


def test_inspect_empty_directory(snap_env, capsys):  # exists, holds nothing: not an error
    snap_env.dir.mkdir()
    rc, out = run_cli(capsys, "inspect", snap_env.dir)
    assert rc == 0 and "no snapshots" in out


# ----------------------------------------------------------------------------- verify

def test_verify_good_and_flipped_byte_names_file_and_chunk(snap_env, capsys):
    model, opt = small_job()
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, chunk_bytes=4096,
                       copy_threads=1)
    try:
        train(model, opt, snap, 2)
        path = snap.flush()
    finally:
        snap.close()
    data = path / "data.bin"
    assert data.stat().st_size > 3 * 4096
    rc, out = run_cli(capsys, "verify", snap_env.dir)
    assert rc == 0 and "step 1" in out and "ok" in out and "FAILED" not in out, out
    flip_byte(data, 2 * 4096 + 123)
    rc, out = run_cli(capsys, "verify", snap_env.dir)
    assert rc != 0
    assert "FAILED" in out and str(data) in out and "chunk 2 " in out, out
    rc, out = run_cli(capsys, "verify", snap_env.dir, "--step", "7")
    assert rc != 0


def test_verify_and_export_of_an_empty_directory_fail_cleanly(snap_env, capsys):
    snap_env.dir.mkdir()
    capsys.readouterr()
    assert cli.main(["verify", str(snap_env.dir)]) == 2  # nothing verified is no success
    assert "no snapshots in" in capsys.readouterr().err
    assert cli.main(["export", str(snap_env.dir), "--to", "torch", str(snap_env.tmp / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cudasnap export: error: no committed snapshot in") and "Traceback" not in err
    assert not (snap_env.tmp / "x.pt").exists()


# ----------------------------------------------------------------------------- gc

@pytest.mark.slow
def test_gc_removes_dead_owners_arena_and_keeps_a_live_one(snap_env, capsys, monkeypatch):
    shm = snap_env.tmp / "shm"  # private: never touch other jobs' arenas in /dev/shm
    shm.mkdir()
    monkeypatch.setenv("CUDASNAP_SHM_DIR", str(shm))
    dead = shm / f"cudasnap-{snap_env.sub_job('dead')}-r0.arena"
    code = ("import sys, torch; from cudasnap._native import native; "
            "native().Arena.create(sys.argv[1], 2, 1 << 16, 4096, 4096, 'dead', True)")
    subprocess.run([sys.executable, "-c", code, str(dead)], env=clean_env(), check=True,
                   timeout=120)
    assert native().Arena.open(str(dead), False).owner_pid > 0
    model, opt = small_job()
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, copy_threads=1)
    try:
        train(model, opt, snap, 1)
        live = snap.arena_path
        assert live.parent == shm and native().Arena.open(str(live), False).owner_pid == os.getpid()
        rc, out = run_cli(capsys, "gc", "--dry-run")
        assert rc == 0
        assert f"would remove {dead}" in out and f"keep   {live} (pid {os.getpid()} alive)" in out
        assert "1 stale arena(s) found" in out and dead.exists() and live.exists()
        rc, out = run_cli(capsys, "gc")
        assert rc == 0 and f"removed {dead}" in out and "1 stale arena(s) removed" in out
        assert not dead.exists() and live.exists()
        train(model, opt, snap, 1, start=1)  # the live job is unharmed
        assert snap.flush().name == "step-00000001"
    finally:
        snap.close()


# ----------------------------------------------------------------------------- health, advise

def test_health_without_nvml_says_so_and_exits_0(capsys):
    if _nvml.init() is None:
        _nvml.shutdown()
        pytest.skip("a real NVML driver is present")
    rc, out = run_cli(capsys, "health")
    assert rc == 0 and "NVML unavailable" in out


def test_advise_prints_both_policies_and_a_recommendation(capsys):
    args = ["advise", "--gpus", "16384", "--mtbf-hours", "50000", "--iter-seconds", "8",
            "--state-gb", "10"]
    rc, out = run_cli(capsys, *args)
    assert rc == 0
    lines = out.splitlines()
    assert any(ln.split()[:1] == ["periodic"] for ln in lines), out
    assert any(ln.split()[:1] == ["jit"] for ln in lines), out
    assert any(ln.startswith("Recommendation: ") and ln.split()[1] in ("jit", "periodic")
               for ln in lines), out
    rc, out = run_cli(capsys, *args, "--json")
    d = json.loads(out)
    assert rc == 0 and {"periodic", "jit", "recommendation"} <= set(d)
    assert d["inputs"]["gpus"] == 16384


# ----------------------------------------------------------------------------- transparent mode

PLAIN_SCRIPT = textwrap.dedent("""
    # An ordinary training script: no cudasnap code at all.
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out, kill_after = sys.argv[1], int(sys.argv[2])
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for i in range(100):
        x = torch.randn(8, 16)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(out, f"state-{i}.pt"))
        if i == kill_after:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
""")


def fresh_pair():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def one_step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_transparent_mode_flush_then_export_loads_into_fresh_model_and_optimizer(snap_env, capsys):
    script = snap_env.tmp / "train.py"
    script.write_text(PLAIN_SCRIPT)
    states = snap_env.tmp / "states"
    states.mkdir()
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--auto", "--dir",
                        str(snap_env.dir), "--max-restarts", "0", "--", sys.executable,
                        str(script), str(states), "7"],
                       env=clean_env(CUDASNAP_JOB=snap_env.job), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 128 + 9, p.stderr[-4000:]
    assert "transparent mode: protecting AdamW (model=Sequential)" in p.stderr, p.stderr[-4000:]
    assert "training process killed by SIGKILL" in p.stderr
    snaps = posix.list_snapshots(snap_env.dir)
    assert snaps and snaps[0].step in (6, 7), p.stderr[-4000:]  # step k = after opt step k
    step = snaps[0].step
    assert f"flushed step {step} left in" in p.stderr
    rc, out = run_cli(capsys, "verify", snap_env.dir)
    assert rc == 0, out

    exported = snap_env.tmp / "out.pt"
    rc, out = run_cli(capsys, "export", snap_env.dir, "--to", "torch", exported)
    assert rc == 0 and str(exported) in out
    d = torch.load(exported, weights_only=True)
    saved = torch.load(states / f"state-{step}.pt", weights_only=True)
    assert d["step"] == step
    m2, o2 = fresh_pair()
    m2.load_state_dict(d["model"])  # strict: every key, BatchNorm buffers included
    o2.load_state_dict(d["optimizer"])
    for k, v in saved["model"].items():
        assert torch.equal(m2.state_dict()[k], v), k
    got, want = o2.state_dict(), saved["optimizer"]
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st), i
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)
    # The exported state resumes like the script's own: one more step, same bytes.
    m3, o3 = fresh_pair()
    m3.load_state_dict(saved["model"])
    o3.load_state_dict(saved["optimizer"])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    one_step(m2, o2, x)
    one_step(m3, o3, x)
    for (k, a), (_, b) in zip(m2.state_dict().items(), m3.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.slow
def test_transparent_mode_numbers_each_runs_snapshots_by_that_run(snap_env):
    """Issue 44 item 6: killed at step 7, the restarted script trains again from its own
    step 0; its snapshots count from 0 too (they went on from the killed run's step, so
    ``step-00000037`` held a fresh run's 30 steps), and the killed run's flushed step is
    kept aside in ``DIR/.old-*``, where ``cudasnap export`` still reads it."""
    script = snap_env.tmp / "train.py"
    script.write_text(PLAIN_SCRIPT.replace("range(100)", "range(30)").replace(
        "if i == kill_after:", "if i == kill_after and os.environ['CUDASNAP_RESTART'] == '0':"))
    states = snap_env.tmp / "states"
    states.mkdir()
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--auto", "--dir",
                        str(snap_env.dir), "--max-restarts", "1", "--", sys.executable,
                        str(script), str(states), "7"],
                       env=clean_env(CUDASNAP_JOB=snap_env.job), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    steps = [s.step for s in posix.list_snapshots(snap_env.dir)]
    assert steps and steps[0] == 29, (steps, p.stderr[-4000:])  # the 2nd run's own last step
    old = sorted(snap_env.dir.glob(".old-*"))
    assert len(old) == 1, p.stderr[-4000:]
    assert [s.step for s in posix.list_snapshots(old[0])][:1] in ([6], [7]), p.stderr[-4000:]
    d = torch.load(states / "state-29.pt", weights_only=True)["model"]
    m = torch.load(_export(snap_env.dir, snap_env.tmp / "out.pt"), weights_only=True)["model"]
    assert all(torch.equal(m[k], v) for k, v in d.items())


def _export(directory, out):
    assert cli.main(["export", str(directory), "--to", "torch", str(out)]) == 0
    return out


# ----------------------------------------------------------------------------- bad input

def cli_err(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err


def test_inspect_of_a_missing_directory_is_an_error(snap_env, capsys):
    rc, err = cli_err(capsys, "inspect", snap_env.tmp / "nope")
    one_line_error(rc, err, "no such directory", str(snap_env.tmp / "nope"))
    assert not (snap_env.tmp / "nope").exists()


@pytest.fixture
def corrupt_snapshot(snap_env):
    model, opt = small_job()
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, chunk_bytes=4096,
                       copy_threads=1)
    try:
        train(model, opt, snap, 2)
        path = snap.flush()
    finally:
        snap.close()
    flip_byte(path / "data.bin", 4096 + 7)
    return path


def test_inspect_never_calls_an_unverified_snapshot_ok(snap_env, capsys, corrupt_snapshot):
    rc, out = run_cli(capsys, "inspect", snap_env.dir)
    row = [ln for ln in out.splitlines() if " disk " in ln]
    assert rc == 0 and len(row) == 1 and " ok" not in row[0] and "unverified" in row[0], out
    rc, out = run_cli(capsys, "inspect", snap_env.dir, "--verify")
    row = [ln for ln in out.splitlines() if " disk " in ln]
    assert "FAILED" in row[0] and "chunk 1 " in row[0] and "(latest)" in row[0], out


def test_export_of_a_corrupt_snapshot_names_file_chunk_and_hex_crcs(snap_env, capsys,
                                                                    corrupt_snapshot):
    rc, err = cli_err(capsys, "export", snap_env.dir, "--to", "torch", snap_env.tmp / "x.pt")
    one_line_error(rc, err, str(corrupt_snapshot / "data.bin"), "chunk 1 ", "stored 0x",
                   "read 0x")
    assert "[check:" not in err and not (snap_env.tmp / "x.pt").exists()


def test_export_refuses_to_overwrite_the_latest_pointer(snap_env, capsys):
    model, opt = small_job()
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, copy_threads=1)
    try:
        train(model, opt, snap, 1)
        snap.flush()
    finally:
        snap.close()
    before = (snap_env.dir / "latest").read_bytes()
    rc, err = cli_err(capsys, "export", snap_env.dir, "--to", "torch", snap_env.dir / "latest")
    one_line_error(rc, err, "latest")
    assert (snap_env.dir / "latest").read_bytes() == before
    rc, err = cli_err(capsys, "export", snap_env.dir, "--to", "torch",
                      snap_env.dir / "step-00000000" / "x.pt")
    one_line_error(rc, err, "snapshot directory")
    assert latest.read_latest(snap_env.dir) == "step-00000000"


@pytest.mark.parametrize("flag", ["--gpus", "--mtbf-hours", "--iter-seconds", "--state-gb"])
def test_advise_refuses_non_positive_inputs(capsys, flag):
    args = {"--gpus": "8", "--mtbf-hours": "100", "--iter-seconds": "1", "--state-gb": "1"}
    args[flag] = "0"
    rc, err = cli_err(capsys, "advise", *[x for kv in args.items() for x in kv])
    one_line_error(rc, err, flag, "positive")


def test_debug_shows_the_traceback(snap_env, capsys):
    with pytest.raises(Exception, match="no such directory"):
        cli.main(["--debug", "inspect", str(snap_env.tmp / "nope")])


def test_console_script_entry_point_resolves_to_the_cli():
    """setup.py's ``cudasnap=`` entry point names an importable main of this checkout."""
    import importlib
    import re

    setup_py = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    m = re.search(r'"cudasnap=([\w.]+):(\w+)"', setup_py)
    assert m, "setup.py declares no cudasnap console script"
    mod = importlib.import_module(m.group(1))
    assert Path(mod.__file__).resolve().is_relative_to(Path(__file__).resolve().parents[2])
    assert getattr(mod, m.group(2)) is cli.main


def test_gc_removes_parity_files_of_dead_makers_and_keeps_live_ones(tmp_path, capsys, monkeypatch):
    # XOR parity files (issue 35 item 6) carry their maker's pid in the trailer
    from cudasnap.distributed.parity import Accumulator, parity_path

    monkeypatch.setenv("CUDASNAP_SHM_DIR", str(tmp_path))
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    paths = {}
    for name, pid in (("dead", int(dead_pid)), ("live", os.getpid())):
        acc = Accumulator(parity_path(tmp_path, f"gc-{name}", 0, 1, 5), 64)
        paths[name] = acc.finish({"sid": 0, "step": 5, "seg": 64, "members": [0, 1],
                                  "holder": 1, "pid": pid, "tag": "t", "images": {}})
    half = tmp_path / f".{parity_path(tmp_path, 'gc-dead', 0, 1, 6).name}.tmp-{dead_pid}"
    half.write_bytes(b"\0" * 64)
    rc, out = run_cli(capsys, "gc")
    assert rc == 0 and f"removed {paths['dead']}" in out and f"removed {half}" in out, out
    assert not paths["dead"].exists() and not half.exists() and paths["live"].exists()
    assert oct(paths["live"].stat().st_mode)[-3:] == "600"


def test_transparent_modes_scan_prints_no_warning_of_its_own() -> None:
    """Issue 44 item 6: the scan for the modules owning an optimizer's parameters touches
    every live object; torch.distributed's deprecated ``reduce_op`` warned into the user's
    log from it."""
    import warnings

    import torch
    import torch.distributed  # noqa: F401 - its lazy deprecated attribute is in the heap


    m = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = parts.auto_live_modules()
    assert any(x is m for x in found)
    assert [str(w.message) for w in seen] == []
