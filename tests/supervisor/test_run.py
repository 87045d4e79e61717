"""The supervisor and the guard end to end: injected faults, signals, the watchdog, NVML
absent, and SIGKILL at seeded random points under ``supervise()`` / ``cudasnap run``.

Training processes (tools/faults/run_trainer.py) are forked from a warm server
that imported torch once (helpers/run_forkserver.py). Under ``supervise()`` the
command is helpers/run_client.py, which has the server fork the trainer with the
supervisor's environment and ends exactly as the trainer ended (exit code or
signal), after the trainer is reaped. One test runs the real ``cudasnap run``
command around a real ``python run_trainer.py`` process.

What is checked is what a user relies on: the exit code the policy names, a
snapshot of the newest COMPLETE step durable on disk (flushed by the dying
process itself, verified chunk by chunk), and after a SIGKILL a resume at the
newest complete step + 1 that ends bitwise equal to an uninterrupted run.
Nothing is asserted about timings.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import parts
from helpers.run_fork import ForkServer

from cudasnap._native import native
from cudasnap.format import paths
from cudasnap.storage import latest, listing, posix
from cudasnap.supervisor.loop import supervise
from cudasnap.supervisor.orphans import flush_orphans
from cudasnap.triggers import nvml as _nvml

TRAINER = Path(__file__).resolve().parents[2] / "tools" / "faults" / "run_trainer.py"
REPO = Path(__file__).resolve().parents[2]
STEPS = 10
TRIALS = int(os.environ.get("CUDASNAP_RUN_TRIALS", "20"))
SEED = int(os.environ.get("CUDASNAP_RUN_SEED", "20261202"))


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ForkServer.start(tmp_path_factory.mktemp("forkserver"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory) -> dict[str, np.ndarray]:
    d = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    p = server.spawn(["--steps", STEPS, "--stats", d / "stats.jsonl", "--out", d / "ref.npz",
                      "--ref"], env, d / "log")
    assert p.wait() == 0, (d / "log").read_text()
    with np.load(d / "ref.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(autouse=True)
def _no_inherited_cudasnap_env(monkeypatch):
    for k in ("CUDASNAP_INJECT", "CUDASNAP_POLICY", "CUDASNAP_WATCHDOG_S", "CUDASNAP_DIR",
              "CUDASNAP_AUTO", "CUDASNAP_RESTART", "CUDASNAP_SUPERVISED", "CUDASNAP_HEALTH"):
        monkeypatch.delenv(k, raising=False)


def trainer_env(snap_env, **extra: str) -> dict[str, str]:
    """What ``cudasnap run`` gives a training process, for one started without it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"CUDASNAP_HEALTH": "1", "CUDASNAP_DIR": str(snap_env.dir),
                "CUDASNAP_JOB": snap_env.job, "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_event(path: Path, ev: str, proc, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(path):
            if e["ev"] == ev:
                return e
        time.sleep(0.02)
    raise AssertionError(f"no {ev!r} event from pid {proc.pid}: {events(path)}")


def arena_newest(path: Path) -> int:
    """Step of the newest COMPLETE slot of an arena file, -1 if none."""
    if not path.exists():
        return -1
    a = native().Arena.open(str(path), False)
    slot = a.newest_complete()
    return a.slot_info(slot)["step"] if slot >= 0 else -1


def verify_ok(directory: Path, step: int, capsys) -> None:
    from cudasnap.tools import cli

    capsys.readouterr()
    rc = cli.main(["verify", str(directory), "--step", str(step)])
    out = capsys.readouterr().out
    assert rc == 0 and f"step {step}" in out and "ok" in out, out


def same_state(npz: Path, ref: dict[str, np.ndarray]) -> None:
    with np.load(npz) as z:
        assert sorted(z.files) == sorted(ref)
        bad = [k for k in z.files if z[k].tobytes() != ref[k].tobytes()]
    assert not bad, f"differs from the uninterrupted run: {bad}"


def run_supervised(server, snap_env, argv: list, log: Path, **kw) -> tuple[int, list[dict]]:
    report: list[dict] = []
    # warm=False: the forkserver client never imports torch; a standby would (the warm
    # path is tested in test_standby.py and by the real run_trainer.py test below).
    kw.setdefault("warm", False)
    rc = supervise(server.client_cmd(argv), snap_env.dir, report=report,
                   extra_env={**server.client_env(log), **kw.pop("extra_env", {})}, **kw)
    return rc, report


# ----------------------------------------------------------------------------- injected faults

FAULTS = [
    # kind, injection, watchdog, exit code, steps that may be the newest COMPLETE one
    ("xid", "xid=79@step=4", None, 76, {3, 4}),
    ("ecc_dbe", "ecc_dbe@step=4", None, 76, {3, 4}),
    ("gpu_lost", "gpu_lost@step=4", None, 75, {3, 4}),
    ("hang", "hang@step=4", 1.0, 77, {3}),
    ("sigterm", "sigterm@step=4", None, 78, {4}),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,spec,watchdog,code,allowed", FAULTS, ids=[f[0] for f in FAULTS])
def test_injected_fault_flushes_newest_complete_step_and_exits_with_policy_code(
        server, snap_env, capsys, kind, spec, watchdog, code, allowed):
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    # After boundary(4) the trainer idles (the fault is due): nothing newer than 4 exists.
    rc, report = run_supervised(server, snap_env, ["--steps", STEPS, "--stats", stats,
                                                   "--stall-after", 4],
                                log, max_restarts=0, inject_first=spec, watchdog_s=watchdog)
    text = log.read_text()
    assert rc == code, text
    assert [r["rc"] for r in report] == [code]
    evs = events(stats)
    pid = evs[0]["pid"]
    assert evs[0]["guard"] and not any(e["ev"] in ("final", "stall_expired", "hang_expired")
                                       for e in evs), evs
    assert f"exiting with code {code} after {kind}" in text, text
    if kind == "hang":
        assert "watchdog: no step boundary" in text
    # The dying process flushed by itself (before the supervisor looked) ...
    mine = [r for r in listing.read_flush_log(snap_env.dir) if r["pid"] == pid]
    assert len(mine) == 1 and mine[0]["step"] in allowed, (mine, text)
    # ... and the newest COMPLETE step it left in shared memory is durable on disk.
    newest = arena_newest(snap_env.arena_path())
    assert newest in allowed
    on_disk = [s.step for s in posix.list_snapshots(snap_env.dir)]
    assert on_disk[0] == newest
    if len(allowed) == 1:  # waited for the running copy: the supervisor had nothing to do
        assert mine[0]["step"] == newest and report[0]["flushed"][0]["skipped"]
    verify_ok(snap_env.dir, newest, capsys)
    assert not list(snap_env.dir.glob("*.tmp*"))


def test_uncaught_exception_flushes_then_the_process_fails(server, snap_env, capsys):
    """``exception@step=4`` raises from boundary(4): the excepthook flushes step 4 (the
    policy's default for an exception is flush), then the traceback, exit code 1."""
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    rc, report = run_supervised(server, snap_env, ["--steps", STEPS, "--stats", stats], log,
                                max_restarts=0, inject_first="exception@step=4")
    text = log.read_text()
    assert rc == 1, text
    assert "InjectedFault: injected fault exception@step=4" in text
    pid = events(stats)[0]["pid"]
    mine = [r for r in listing.read_flush_log(snap_env.dir) if r["pid"] == pid]
    assert [r["step"] for r in mine] == [4], text
    assert report[0]["flushed"][0]["skipped"]
    verify_ok(snap_env.dir, 4, capsys)


@pytest.mark.slow
def test_sigterm_to_cudasnap_run_is_forwarded_flushed_and_not_restarted(server, snap_env, tmp_path):
    stats, log = tmp_path / "stats.jsonl", tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"CUDASNAP_JOB": snap_env.job, **server.client_env(log),
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    sup = subprocess.Popen([sys.executable, "-m", "cudasnap", "run", "--dir", str(snap_env.dir),
                            "--max-restarts", "3", "--no-warm", "--",
                            *server.client_cmd(["--steps", STEPS, "--stats", stats,
                                                "--stall-after", 4])],
                           env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_event(stats, "stalled", sup, timeout=120)
        sup.send_signal(signal.SIGTERM)
        _, err = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert sup.returncode == 78, err
    assert "forwarding SIGTERM to the training process" in err
    assert "stop requested: not restarting" in err and "restarting" not in err.replace(
        "not restarting", "")
    assert [e["attempt"] for e in events(stats) if e["ev"] == "start"] == [0]
    pid = events(stats)[0]["pid"]
    assert [r["step"] for r in listing.read_flush_log(snap_env.dir) if r["pid"] == pid] == [4]
    assert "exiting with code 78 after sigterm" in log.read_text()


def test_sigterm_just_before_the_child_starts_still_reaches_it(snap_env, monkeypatch):
    """A stop signal in the gap before Popen returns is forwarded once the child exists."""
    import cudasnap.supervisor.loop as runmod

    real = subprocess.Popen

    def popen_after_sigterm(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # handled by supervise()'s forwarder
        time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(runmod.subprocess, "Popen", popen_after_sigterm)
    report: list[dict] = []
    rc = supervise([sys.executable, "-c", "import time; time.sleep(60)"], snap_env.dir,
                   max_restarts=3, report=report)
    assert rc == 128 + signal.SIGTERM and [r["rc"] for r in report] == [-signal.SIGTERM]


def test_cudasnap_run_without_a_command_says_how():
    from cudasnap.supervisor.run import main

    with pytest.raises(SystemExit, match="no command given"):
        main(["--max-restarts", "0"])


@pytest.mark.parametrize("at", [3, STEPS - 1], ids=["mid-run", "last-step"])
def test_sigusr1_flushes_and_training_continues(server, snap_env, reference, at):
    """Flush and go on. At the last step the flush overlaps the end of training: close()
    must let it finish instead of removing the arena under it."""
    stats, log, out = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log", snap_env.tmp / "out.npz"
    rc, report = run_supervised(server, snap_env, ["--steps", STEPS, "--stats", stats,
                                                   "--out", out, "--slow-flush", 0.5],
                                log, max_restarts=0, inject_first=f"sigusr1@step={at}")
    assert rc == 0, log.read_text()
    assert len(report) == 1
    evs = events(stats)
    final = evs[-1]
    assert final["ev"] == "final" and final["start"] == 0 and final["attempt"] == 0
    assert ["sigusr1", "flushed"] in final["triggers"]
    flushes = [r for r in listing.read_flush_log(snap_env.dir) if r["pid"] == evs[0]["pid"]]
    assert at <= flushes[0]["step"] < STEPS, log.read_text()
    # close() flushed the final step unless the SIGUSR1 flush already wrote it.
    assert [r["step"] for r in flushes[1:]] == ([] if flushes[0]["step"] == STEPS - 1
                                                else [STEPS - 1]), flushes
    # The flush did not perturb training: still bitwise the uninterrupted run.
    same_state(out, reference)


POLICIES = [
    # injection, CUDASNAP_POLICY, exit code, the process flushes
    ("xid=79@step=3", "xid.fatal=flush", 0, True),
    ("gpu_lost@step=3", "gpu_lost=log", 0, False),
    ("sigterm@step=4", "sigterm=flush_exit:90", 90, True),
]


@pytest.mark.parametrize("spec,policy,code,flushes", POLICIES, ids=[p[1] for p in POLICIES])
def test_policy_override_changes_the_outcome(server, snap_env, reference, spec, policy, code,
                                             flushes):
    stats, log, out = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log", snap_env.tmp / "out.npz"
    argv = ["--steps", STEPS, "--stats", stats, "--out", out]
    if code:
        argv += ["--stall-after", 4]
    rc, _ = run_supervised(server, snap_env, argv, log, max_restarts=0, inject_first=spec,
                           extra_env={"CUDASNAP_POLICY": policy})
    assert rc == code, log.read_text()
    evs = events(stats)
    mine = [r for r in listing.read_flush_log(snap_env.dir) if r["pid"] == evs[0]["pid"]]
    if code == 0:  # the run ended with close(), which flushed the final step (flush_on_close)
        assert mine and mine[-1]["step"] == STEPS - 1, mine
        mine = mine[:-1]
    assert bool(mine) == flushes, mine
    if code == 0:  # the job went on to the end, bit for bit
        assert evs[-1]["ev"] == "final" and evs[-1]["start"] == 0
        same_state(out, reference)


def test_sigterm_while_main_thread_blocked_in_c_flushes_via_signal_thread(server, snap_env, capsys):
    """SIGTERM is masked on the main thread, which then waits in C (a lock acquire with the
    GIL released): a Python-level handler would never run. The C signal pipe's thread
    must flush and exit 78."""
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    p = server.spawn(["--steps", STEPS, "--stats", stats, "--block-after", 5],
                     trainer_env(snap_env), log)
    try:
        wait_for_event(stats, "blocked", p)
        os.kill(p.pid, signal.SIGTERM)
        rc = p.wait(60)
    finally:
        if p.returncode is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    text = log.read_text()
    assert rc == 78, text
    exits = [ln for ln in text.splitlines() if "exiting with code 78 after sigterm" in ln]
    assert len(exits) == 1 and " cudasnap-signals " in exits[0], text
    assert not any(e["ev"] == "block_expired" for e in events(stats))
    mine = [r for r in listing.read_flush_log(snap_env.dir) if r["pid"] == p.pid]
    assert [r["step"] for r in mine] == [5]
    assert latest.read_latest(snap_env.dir) == "step-00000005"
    verify_ok(snap_env.dir, 5, capsys)


@pytest.mark.slow
def test_watchdog_quiet_on_a_slow_loop_within_its_limit(server, snap_env):
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    # 10 steps of 0.25 s: the run outlasts the 2 s limit, no gap between boundaries does.
    p = server.spawn(["--steps", STEPS, "--stats", stats, "--sleep-per-step", 0.25],
                     trainer_env(snap_env, CUDASNAP_WATCHDOG_S="2.0"), log)
    rc = p.wait(120)
    text = log.read_text()
    assert rc == 0, text
    assert "watchdog 2.0 s" in text  # it was on
    assert "watchdog:" not in text and "trigger hang" not in text
    final = events(stats)[-1]
    assert final["ev"] == "final" and final["triggers"] == []
    # No watchdog flush: the only one is close()'s flush of the final step (flush_on_close).
    assert [r["step"] for r in listing.read_flush_log(snap_env.dir)] == [STEPS - 1]


@pytest.mark.slow
def test_watchdog_quiet_during_the_users_own_long_flush(server, snap_env):
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    p = server.spawn(["--steps", 4, "--stats", stats, "--flush-end", "--slow-flush", 2.0],
                     trainer_env(snap_env, CUDASNAP_WATCHDOG_S="1.0"), log)
    rc = p.wait(120)
    assert rc == 0, log.read_text()


def test_nvml_absent_logged_once_and_everything_else_works(server, snap_env):
    if _nvml.init() is None:
        _nvml.shutdown()
        pytest.skip("a real NVML driver is present")
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    p = server.spawn(["--steps", 6, "--stats", stats, "--flush-end", "--second-snapshotter"],
                     trainer_env(snap_env), log)
    rc = p.wait(120)
    text = log.read_text()
    assert rc == 0, text
    lines = [ln for ln in text.splitlines() if "NVML unavailable" in ln]
    assert len(lines) == 1, lines  # two Snapshotters with health on, one process
    # INFO: no CUDA device is in use in this CPU-only trainer (a WARNING where one is)
    assert ("WARNING" if parts.cuda_in_use() else "INFO") in lines[0]
    assert "signal/watchdog/exception triggers remain active" in lines[0]
    evs = events(stats)
    assert evs[0]["guard"]
    final = [e for e in evs if e["ev"] == "final"][0]
    assert final["flushed"].endswith("step-00000005")
    second = [e for e in evs if e["ev"] == "second"][0]
    assert second["guard"] and second["flushed"].endswith("step-00000006")
    assert [s.step for s in posix.list_snapshots(snap_env.dir)] == [5]
    assert [s.step for s in posix.list_snapshots(Path(str(snap_env.dir) + "-2"))] == [6]


# ----------------------------------------------------------------------------- SIGKILL trials

def expected_newest(k: int, phase: str) -> set[int]:
    """Steps that can be the newest COMPLETE one when a kill lands at (k, phase).

    Copy k-1 is certainly COMPLETE once step k's optimizer step passed its fence;
    before that (pre, mid) it may still run. After boundary(k) copy k runs; after
    wait() (and in the flush that follows) it is COMPLETE.
    """
    exp = {"pre": {k - 2, k - 1}, "mid": {k - 2, k - 1}, "post_opt": {k - 1},
           "post_boundary": {k - 1, k}, "post_wait": {k}, "flush": {k}}[phase]
    return {max(s, -1) for s in exp}


def _trials() -> list[tuple[int, str]]:
    from tools.faults.run_trainer import PHASES

    rng = random.Random(SEED)
    # Every phase at least twice, then seeded random points.
    out = [(rng.randrange(STEPS), ph) for ph in PHASES for _ in range(2)]
    out += [(rng.randrange(STEPS), rng.choice(PHASES)) for _ in range(TRIALS - len(out))]
    rng.shuffle(out)
    return out[:TRIALS]


@pytest.mark.slow
def test_sigkill_at_random_points_resumes_at_newest_complete_plus_one(
        server, snap_env, reference, monkeypatch, capsys):
    seen: Counter[str] = Counter()
    for i, (k, phase) in enumerate(_trials()):
        job = snap_env.sub_job(f"k{i}")
        monkeypatch.setenv("CUDASNAP_JOB", job)
        d = snap_env.tmp / f"trial{i}"
        stats, log, out = d / "stats.jsonl", d / "log", d / "out.npz"
        d.mkdir()
        what = f"trial {i}: SIGKILL at step {k} phase {phase} (log {log})"
        report: list[dict] = []
        rc = supervise(server.client_cmd(["--steps", STEPS, "--stats", stats, "--out", out,
                                          "--kill-at", k, "--kill-phase", phase]),
                       d / "ckpt", max_restarts=1, report=report, extra_env=server.client_env(log),
                       warm=False)
        assert rc == 0, what
        assert [r["rc"] for r in report] == [-signal.SIGKILL, 0], what
        evs = events(stats)
        assert [e["ev"] for e in evs if e["ev"] in ("kill",)] == ["kill"], what
        starts = [e for e in evs if e["ev"] == "start"]
        assert [s["attempt"] for s in starts] == [0, 1], what
        flushed = report[0]["flushed"]
        newest = flushed[0]["step"] if flushed else -1
        assert len(flushed) <= 1 and not any(f.get("skipped") for f in flushed), what
        assert newest in expected_newest(k, phase), (what, newest)
        assert starts[1]["start"] == newest + 1, (what, starts[1])
        if newest >= 0:
            assert starts[1]["restore"]["step"] == newest, what
            assert (d / "ckpt" / paths.step_dirname(newest)).is_dir(), what
        if phase == "flush":  # the torn flush of the dead process is gone after the restart
            verify_ok(d / "ckpt", k, capsys)
        assert not list((d / "ckpt").glob("*.tmp*")), what
        same_state(out, reference)
        seen[phase] += 1
    assert len(seen) == 6 and sum(seen.values()) == TRIALS


@pytest.mark.slow
def test_cudasnap_run_cli_with_a_real_process(snap_env, reference, tmp_path):
    """``cudasnap run`` (the command) around ``python run_trainer.py``, killed after its
    optimizer step at step 5: flushed step 4, resumed at 5, bitwise equal."""
    stats, out = tmp_path / "stats.jsonl", tmp_path / "out.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"CUDASNAP_JOB": snap_env.job, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", str(snap_env.dir),
                        "--max-restarts", "1", "--", sys.executable,
                        str(TRAINER), "--steps", str(STEPS), "--stats",
                        str(stats), "--out", str(out), "--kill-at", "5", "--kill-phase",
                        "post_opt"], env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "training process killed by SIGKILL (attempt 0)" in p.stderr
    assert "flushed step 4 left in" in p.stderr and "restarting (restart 1 of 1)" in p.stderr
    starts = [e for e in events(stats) if e["ev"] == "start"]
    assert [(s["attempt"], s["start"]) for s in starts] == [(0, 0), (1, 5)]
    assert starts[1]["restore"]["source"] == "shm"
    same_state(out, reference)


def test_flush_orphans_skips_steps_on_disk_and_arenas_without_snapshot(snap_env, server):
    """The supervisor's flush of a dead process's arena, called directly."""
    stats, log = snap_env.tmp / "stats.jsonl", snap_env.tmp / "log"
    env = trainer_env(snap_env)
    del env["CUDASNAP_HEALTH"]
    p = server.spawn(["--steps", 3, "--stats", stats, "--exit-hard"], env, log)
    assert p.wait() == 0, log.read_text()
    first = flush_orphans(snap_env.dir, snap_env.job, snap_env.shm)
    assert [(f["step"], f.get("skipped", False)) for f in first] == [(2, False)]
    again = flush_orphans(snap_env.dir, snap_env.job, snap_env.shm)
    assert [(f["step"], f.get("skipped", False)) for f in again] == [(2, True)]
    assert flush_orphans(snap_env.dir, snap_env.sub_job("none"), snap_env.shm) == []
