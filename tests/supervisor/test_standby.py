"""The warm standby of ``cudasnap run`` (cudasnap.supervisor.standby): which commands it takes,
and that a standby runs the script only on ``go``, as ``python`` would, with its exit code."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudasnap.supervisor.standby import warm_command

SCRIPT = """
import json, os, sys
import torch  # already imported by the standby
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "restart": os.environ.get("CUDASNAP_RESTART"), "torch": torch.__version__}))
sys.exit(int(sys.argv[1]))
"""


def test_warm_command_takes_plain_python_scripts_and_modules_only():
    py = sys.executable
    assert warm_command([py, "train.py", "--lr", "1"]) == ["train.py", "--lr", "1"]
    assert warm_command(["python3", "-m", "pkg.train", "x"]) == ["-m", "pkg.train", "x"]
    assert warm_command([py, "-u", "train.py"]) is None  # interpreter options: cold
    assert warm_command([py, "-c", "print(1)"]) is None
    assert warm_command([py, "-m"]) is None
    assert warm_command(["torchrun", "--nproc-per-node=2", "train.py"]) is None
    assert warm_command(["/bin/sh", "train.sh"]) is None
    assert warm_command([py]) is None


def start(tmp_path: Path, args: list[str]) -> tuple[subprocess.Popen, int]:
    r, w = os.pipe()
    env = dict(os.environ, CUDASNAP_RESTART="1")
    p = subprocess.Popen([sys.executable, "-m", "cudasnap.supervisor.standby", str(r), "--", *args],
                         env=env, pass_fds=(r,), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    os.close(r)
    return p, w


@pytest.mark.slow
def test_go_runs_the_script_as_main_with_its_argv_and_exit_code(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "train.py").write_text(SCRIPT)
    p, w = start(tmp_path, ["sub/train.py", "7"])
    os.write(w, b"go\n")
    os.close(w)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 7, err
    import json

    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["name"] == "__main__"
    assert rec["argv"] == ["sub/train.py", "7"]
    assert rec["path0"] == str(sub)  # the script's folder, as `python sub/train.py` sets it
    assert rec["restart"] == "1"


@pytest.mark.slow
def test_go_runs_a_module_like_python_dash_m(tmp_path):
    (tmp_path / "mytrain.py").write_text(SCRIPT)
    p, w = start(tmp_path, ["-m", "mytrain", "0"])
    os.write(w, b"go\n")
    os.close(w)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert '"name": "__main__"' in out and "mytrain.py" in out, out


@pytest.mark.slow
def test_a_closed_pipe_ends_the_standby_without_running_anything(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    p, w = start(tmp_path, ["train.py"])
    os.close(w)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert not marker.exists()


# --------------------------------------------------------- wired into cudasnap run (supervise)
RECORDER = """
import json, os, signal, sys
pre = "torch" in sys.modules  # before this script imports anything heavy
sb = sys.modules.get("cudasnap.supervisor.standby")
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"restart": os.environ["CUDASNAP_RESTART"], "pid": os.getpid(),
                        "torch_preloaded": pre, "go": getattr(sb, "go_time", None)}) + "\\n")
if os.environ["CUDASNAP_RESTART"] == "0" and sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _supervised(snap_env, mode: str, warm: bool, max_restarts: int = 1):
    import json

    from cudasnap.supervisor.loop import supervise

    script, log = snap_env.tmp / "rec_train.py", snap_env.tmp / "rec.jsonl"
    script.write_text(RECORDER)
    report: list[dict] = []
    rc = supervise([sys.executable, str(script), str(log), mode], snap_env.dir,
                   max_restarts=max_restarts, report=report, warm=warm)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    return rc, report, recs, script


def _processes_running(needle: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_the_restart_after_a_death_runs_in_the_warm_standby(snap_env):
    rc, report, recs, script = _supervised(snap_env, "die", warm=True)
    assert rc == 0, report
    assert [r["rc"] for r in report] == [-9, 0]
    assert [r["warm"] for r in report] == [False, True]
    assert [r["restart"] for r in recs] == ["0", "1"]
    assert recs[0]["torch_preloaded"] is False and recs[0]["go"] is None  # the first is cold
    assert recs[1]["torch_preloaded"] is True  # imported before the death
    assert recs[1]["go"] is not None and recs[1]["go"] >= report[0]["died"]
    assert not _processes_running(str(script))


def test_no_warm_restarts_cold(snap_env):
    rc, report, recs, _ = _supervised(snap_env, "die", warm=False)
    assert rc == 0 and [r["warm"] for r in report] == [False, False]
    assert [r["torch_preloaded"] for r in recs] == [False, False]


def test_an_unused_standby_is_reaped_when_the_job_finishes(snap_env):
    rc, report, recs, script = _supervised(snap_env, "live", warm=True, max_restarts=2)
    assert rc == 0 and len(report) == 1 and len(recs) == 1
    assert not _processes_running(str(script)), "a standby outlived its supervisor's job"


def test_a_standby_that_died_means_a_cold_start(tmp_path):
    from cudasnap.supervisor.standby import Standby

    (tmp_path / "t.py").write_text("pass\n")
    sb = Standby.spawn([sys.executable, str(tmp_path / "t.py")], dict(os.environ))
    assert sb is not None
    sb.proc.kill()
    sb.proc.wait()
    assert sb.go() is None
    assert Standby.spawn(["/bin/sh", "t.sh"], dict(os.environ)) is None  # not a python command
