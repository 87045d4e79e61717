"""``cudasnap run`` at its edges (issue 23 items 3 and 6): a restarted child never
outlives its supervisor, a dead supervisor's orphan does not block the next job, a
configuration error is not restarted, a SIGSTOPped child is noticed, a damaged newest
snapshot is not announced as the resume point, an interrupted flush leaves no
``step-N.tmp-*``, and ``cudasnap run --`` without a command is a usage error.

Children are tiny python/sh scripts: what is tested is the supervisor. Synchronisation
is by FIFOs, pipes and pidfds; timeouts are failure guards only.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import parts

from cudasnap.storage import posix
from cudasnap.supervisor.loop import supervise

REPO = Path(__file__).resolve().parents[2]
GUARD_S = 120.0  # failure guard for every wait below (never reached when things work)


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def start_run(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen[str]:
    """``cudasnap run ARGS`` in its own session (its own process group, as under a
    scheduler): the test can kill that group without killing itself."""
    return subprocess.Popen([sys.executable, "-m", "cudasnap", "run", *args], env=env,
                            start_new_session=True, text=True, **kw)


def read_fifo(path: Path, timeout: float = GUARD_S) -> str:
    """The first line written to FIFO ``path`` (blocking open+read in a helper thread)."""
    out: list[str] = []

    def reader() -> None:
        with open(path) as f:
            out.append(f.readline())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():  # unblock the reader, then fail
        with open(path, "w"):
            pass
        t.join(5)
        raise AssertionError(f"nothing written to {path} within {timeout:.0f} s")
    return out[0]


def wait_gone(pid: int, timeout: float = GUARD_S) -> bool:
    """True once ``pid`` has exited (a pidfd: no polling), False after ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# Attempt 0 dies at once; attempt 1 (warm: it runs in the standby) takes the directory
# lock as a training process does, writes "PID WARM" to the FIFO argv[1] and waits.
# argv[2] (optional): on SIGTERM, write "term" to that FIFO, then wait for a line on
# FIFO argv[3] before exiting (a training process flushing as it was told to stop).
TRAINER = r"""
import os, signal, sys
from cudasnap.storage import ownership, posix
if os.environ["CUDASNAP_RESTART"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
lock = ownership.DirectoryLock(os.environ["CUDASNAP_DIR"])
lock.acquire()
if len(sys.argv) > 2:
    def on_term(signum, frame):
        with open(sys.argv[2], "w") as f:
            f.write("term\n")
        with open(sys.argv[3]) as f:
            f.readline()
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
warm = getattr(sys.modules.get("cudasnap.supervisor.standby"), "go_time", None) is not None
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {int(warm)}\n")
while True:
    signal.pause()
"""


def _restarted_once(snap_env, *extra: str) -> tuple[subprocess.Popen[str], int]:
    """A ``cudasnap run`` whose first attempt died and whose (warm) restart now runs;
    returns (the supervisor, the restarted training process's pid)."""
    script, fifo = snap_env.tmp / "trainer.py", snap_env.tmp / "up.fifo"
    script.write_text(TRAINER)
    os.mkfifo(fifo)
    with open(snap_env.tmp / "supervisor.log", "w") as log:  # (a file: the children hold it)
        sup = start_run(["--dir", str(snap_env.dir), "--max-restarts", "2", "--",
                         sys.executable, str(script), str(fifo), *extra],
                        cli_env(CUDASNAP_JOB=snap_env.job), stderr=log)
    try:
        pid, warm = map(int, read_fifo(fifo).split())
    except BaseException:
        os.killpg(sup.pid, signal.SIGKILL)
        raise
    assert warm == 1, "the restart did not run in the warm standby"
    return sup, pid


def _next_job_starts(snap_env) -> None:
    marker = snap_env.tmp / "next-ran"
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", str(snap_env.dir),
                        "--max-restarts", "0", "--", "sh", "-c", f"touch {marker}"],
                       env=cli_env(CUDASNAP_JOB=snap_env.job), capture_output=True, text=True,
                       timeout=GUARD_S * 2)
    assert p.returncode == 0 and marker.exists(), p.stderr


@pytest.mark.slow
def test_a_group_kill_after_a_restart_leaves_no_survivor_and_the_next_job_starts(snap_env):
    """Item 3: ``kill -9 -- -PGID`` of the supervisor (what a scheduler does) after one
    (warm) restart ends the training process too; the next job on the directory starts."""
    sup, pid = _restarted_once(snap_env)
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait(timeout=GUARD_S)
    gone = wait_gone(pid)
    if not gone:
        kill_quietly(pid)
    assert gone, f"training process {pid} survived the kill of its supervisor's group"
    _next_job_starts(snap_env)


@pytest.mark.slow
def test_a_supervisor_killed_alone_stops_its_child_and_the_next_job_waits_for_it(snap_env):
    """Item 3: only the supervisor is killed (OOM killer, ``kill -9 PID``): its training
    process gets SIGTERM (PR_SET_PDEATHSIG) and, while it flushes and exits, still holds
    the directory: the next ``cudasnap run`` waits for it, then starts."""
    term, release = snap_env.tmp / "term.fifo", snap_env.tmp / "release.fifo"
    os.mkfifo(term)
    os.mkfifo(release)
    sup, pid = _restarted_once(snap_env, str(term), str(release))
    try:
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(timeout=GUARD_S)
        assert read_fifo(term).strip() == "term"  # the orphan was told to stop
        marker = snap_env.tmp / "next-ran"
        nxt = start_run(["--dir", str(snap_env.dir), "--max-restarts", "0", "--", "sh", "-c",
                         f"touch {marker}"], cli_env(CUDASNAP_JOB=snap_env.job),
                        stderr=subprocess.PIPE)
        seen = []
        for line in nxt.stderr:  # until it says it waits for the orphan (or it exits)
            seen.append(line)
            if "waiting up to" in line:
                break
        assert any(f"held by pid {pid}" in ln and f"(pid {sup.pid}) that died" in ln
                   for ln in seen), "".join(seen)
        with open(release, "w") as f:  # the orphan's flush is done: it exits
            f.write("go\n")
        _, err = nxt.communicate(timeout=GUARD_S)
        assert nxt.returncode == 0 and marker.exists(), "".join(seen) + err
        assert wait_gone(pid)
    finally:
        kill_quietly(pid)


def test_run_without_a_command_is_a_usage_error_exit_2(snap_env):
    """Item 6: ``cudasnap run --dir X --`` is a usage error: exit 2, the usage, one line."""
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", str(snap_env.dir),
                        "--"], env=cli_env(), capture_output=True, text=True, timeout=GUARD_S)
    assert p.returncode == 2, p.stderr
    assert "usage: cudasnap run" in p.stderr and "no command given" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


# Records each attempt, then fails with a configuration error (every attempt), or (argv[2]
# "die-first") is SIGKILLed on attempt 0 and fails with it on the (warm) restart.
CONFIG_FAIL = r"""
import json, os, signal, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"restart": os.environ["CUDASNAP_RESTART"]}) + "\n")
if sys.argv[2] == "die-first" and os.environ["CUDASNAP_RESTART"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
from cudasnap.errors import StagingError
raise StagingError("cannot create the staging arena: /dev/shm has 64 KiB free, the arena "
                   "needs 10 MiB")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode,attempts", [("always", 1), ("die-first", 2)])
def test_a_configuration_error_is_not_restarted(snap_env, caplog, mode, attempts):
    """Item 6: a StagingError (a /dev/shm too small) ends the run with that error, on the
    cold first attempt and on a warm restart alike; no further attempt is started."""
    script, rec = snap_env.tmp / "fail.py", snap_env.tmp / "attempts.jsonl"
    script.write_text(CONFIG_FAIL)
    report: list[dict] = []
    caplog.set_level(logging.WARNING, logger="cudasnap.run")
    rc = supervise([sys.executable, str(script), str(rec), mode], snap_env.dir,
                   max_restarts=3, report=report)
    assert rc == 1
    assert len(rec.read_text().splitlines()) == attempts, report
    assert len(report) == attempts and "StagingError" in report[-1]["config_error"]
    assert any("configuration error" in r.getMessage() and "/dev/shm has 64 KiB free" in
               r.getMessage() and "not restarting" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_an_ordinary_failure_is_still_restarted(snap_env):
    """The verdict file is per attempt: a crash that is no configuration error restarts."""
    script = snap_env.tmp / "crash.py"
    script.write_text("import os, sys\n"
                      "sys.exit(0 if os.environ['CUDASNAP_RESTART'] == '1' else 3)\n")
    report: list[dict] = []
    rc = supervise([sys.executable, str(script)], snap_env.dir, max_restarts=2, report=report)
    assert rc == 0 and [r["rc"] for r in report] == [3, 0]


STOPS_ITSELF = r"""
import os, signal, sys
if os.environ["CUDASNAP_RESTART"] == "0":
    os.kill(os.getpid(), signal.SIGSTOP)
    sys.exit(9)  # continued by someone: not what the test expects
"""


@pytest.mark.slow
def test_a_sigstopped_child_is_noticed_and_treated_as_a_hang(snap_env):
    """Item 6: a child frozen by SIGSTOP cannot run its own watchdog; the supervisor
    notices the stop (waitpid WUNTRACED), logs it, and after the watchdog treats it as a
    hang (hang policy: killed, restarted)."""
    script = snap_env.tmp / "stop.py"
    script.write_text(STOPS_ITSELF)
    sup = start_run(["--dir", str(snap_env.dir), "--watchdog", "1", "--max-restarts", "1",
                     "--no-warm", "--", sys.executable, str(script)],
                    cli_env(CUDASNAP_JOB=snap_env.job), stderr=subprocess.PIPE)
    try:
        _, err = sup.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(sup.pid, signal.SIGKILL)
        _, err = sup.communicate()
        raise AssertionError(f"the supervisor never noticed its stopped child:\n{err}")
    assert sup.returncode == 0, err
    assert "stopped by SIGSTOP" in err and "treated as a hang" in err, err
    assert "restarting (restart 1 of 1)" in err, err


def _two_flushed_steps(snap_env) -> Path:
    import torch

    from cudasnap.snapshotter import Snapshotter

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, copy_threads=1,
                       flush_on_close=False)
    try:
        for step in (20, 30):
            snap.boundary(step)
            snap.wait()
            snap.flush()
    finally:
        snap.close()
    assert not snap_env.arena_files()  # only the disk copies remain
    return snap_env.dir / "step-00000030"


@pytest.mark.parametrize("damage", ["truncated-data", "bad-manifest"])
def test_a_damaged_newest_snapshot_is_not_announced_as_the_resume_point(snap_env, caplog,
                                                                         damage):
    """Item 6: the supervisor names only a snapshot that passes what it checks (manifest
    CRC, data size) and says that the data's checksums are the training process's to
    verify; a damaged step 30 is logged as such and step 20 named instead."""
    step30 = _two_flushed_steps(snap_env)
    if damage == "truncated-data":
        data = step30 / "data.bin"
        os.truncate(data, data.stat().st_size - 1)
    else:
        man = step30 / "manifest.json"
        raw = bytearray(man.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        man.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="cudasnap.run")
    assert supervise(["true"], snap_env.dir, max_restarts=0) == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "resuming from step 30" not in text, text
    assert "step 30" in text and "is damaged" in text, text
    assert "resuming from step 20" in text and "verifies every checksum" in text, text


def test_the_resume_line_says_what_was_verified(snap_env, caplog):
    """A sound step is named with what the supervisor checked and what it did not."""
    _two_flushed_steps(snap_env)
    caplog.set_level(logging.WARNING, logger="cudasnap.run")
    assert supervise(["true"], snap_env.dir, max_restarts=0) == 0
    line = next(r.getMessage() for r in caplog.records if "resuming from" in r.getMessage())
    assert "step 30" in line and "unless the training process finds it damaged" in line


def test_an_interrupted_supervisor_flush_leaves_no_tmp_directory(snap_env, monkeypatch):
    """Item 6: the supervisor's own flush of the dead attempt's arena fails half-way with
    an unexpected error: logged, and its ``step-N.tmp-<pid>`` removed (not left for the
    next start), the arena kept."""
    import torch

    from cudasnap.snapshotter import Snapshotter

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, copy_threads=1,
                       flush_on_close=False)
    try:
        snap.boundary(7)
        snap.wait()
    finally:
        snap.close(keep_arena=True)  # what a killed attempt leaves: a COMPLETE slot
    made: list[Path] = []

    def breaks_half_way(arena, slot, directory, **kw):
        tmp = Path(directory) / f"step-00000007.tmp-{os.getpid()}"
        tmp.mkdir(mode=0o700)
        (tmp / "data.bin").write_bytes(b"partial")
        made.append(tmp)
        raise RuntimeError("the native writer failed")  # not an OSError/SnapshotError

    monkeypatch.setattr(posix, "write_slot", breaks_half_way)
    report: list[dict] = []
    rc = supervise(["sh", "-c", "exit 3"], snap_env.dir, max_restarts=0, report=report)
    assert rc == 3 and made
    assert not list(snap_env.dir.glob("step-*.tmp-*")), list(snap_env.dir.iterdir())
    assert "native writer failed" in report[0]["flushed"][0]["error"]
    assert snap_env.arena_files()  # kept: a restarted job restores from it


def test_supervisor_api_refuses_a_collapsed_object_store_url(snap_env):
    """Item 5 (API side): a URL that a Path collapsed (``s3:/b/p``) is refused before
    anything is created. (A URL string is supervised: tests/storage/test_s3_ranks.py.)"""
    from cudasnap.errors import ConfigError

    os.chdir(snap_env.tmp)
    with pytest.raises(ConfigError, match="object stores"):
        supervise(["true"], Path("s3://bucket/run"), max_restarts=0)  # type: ignore[arg-type]
    assert not (snap_env.tmp / "s3:").exists()


def test_cli_run_refuses_fresh_on_an_object_store_directory(snap_env):
    """``cudasnap run --dir s3://... --fresh`` (nothing can be moved aside in a store) is
    one clear line, exit 2, before any network use, and creates no ``./s3:`` folder."""
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", "s3://bucket/run",
                        "--fresh", "--", "true"], env=cli_env(), capture_output=True, text=True,
                       cwd=snap_env.tmp, timeout=GUARD_S)
    assert p.returncode == 2, p.stderr
    assert "fresh" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1, p.stderr
    assert not (snap_env.tmp / "s3:").exists()


def test_verdict_file_is_private_and_names_the_error(tmp_path, monkeypatch):
    """The record a cold/warm attempt leaves for the supervisor: 0600, kind and error."""
    from cudasnap.errors import ConfigError
    from cudasnap.supervisor.standby import VERDICT_ENV, write_verdict

    path = tmp_path / "verdict.json"
    monkeypatch.setenv(VERDICT_ENV, str(path))
    write_verdict(ConfigError("bad CUDASNAP_NUM_SLOTS"))
    assert path.stat().st_mode & 0o777 == 0o600
    rec = json.loads(path.read_text())
    assert rec["kind"] == "config" and rec["error"] == "ConfigError: bad CUDASNAP_NUM_SLOTS"
    assert parts.read_verdict(path) == "ConfigError: bad CUDASNAP_NUM_SLOTS"
    assert not path.exists()


SMALL_SHM_TRAINER = r"""
import torch, cudasnap, json, os, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"restart": os.environ["CUDASNAP_RESTART"]}) + "\n")
model = torch.nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
snap = cudasnap.Snapshotter(model, opt, copy_threads=1)  # directory, job, shm from cudasnap run
snap.restore_latest()
for step in range(1000):
    snap.boundary(step)  # raises the arena set-up's StagingError
snap.close()
"""


@pytest.fixture
def tiny_shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield d
    if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.mark.slow
def test_a_real_too_small_shm_stops_the_run_without_a_restart(snap_env, tiny_shm, caplog):
    """Item 6, end to end: a real Snapshotter under ``cudasnap run`` whose /dev/shm (a
    64 KiB tmpfs) cannot hold the arena: one attempt, the StagingError logged, exit 1."""
    script, rec = snap_env.tmp / "train.py", snap_env.tmp / "attempts.jsonl"
    script.write_text(SMALL_SHM_TRAINER)
    caplog.set_level(logging.WARNING, logger="cudasnap.run")
    report: list[dict] = []
    rc = supervise([sys.executable, str(script), str(rec)], snap_env.dir, max_restarts=3,
                   shm_dir=tiny_shm, report=report, extra_env={"OMP_NUM_THREADS": "1"})
    assert rc == 1 and len(report) == 1, report
    assert len(rec.read_text().splitlines()) == 1
    assert "StagingError" in report[0]["config_error"] and "free" in report[0]["config_error"]
