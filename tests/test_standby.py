"""The warm standby of ``cudasnap run`` (cudasnap.tools.standby): which commands it takes,
and that a standby runs the script only on ``go``, as ``python`` would, with its exit code."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cudasnap.tools.standby import warm_command

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
    p = subprocess.Popen([sys.executable, "-m", "cudasnap.tools.standby", str(r), "--", *args],
                         env=env, pass_fds=(r,), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    os.close(r)
    return p, w


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


def test_go_runs_a_module_like_python_dash_m(tmp_path):
    (tmp_path / "mytrain.py").write_text(SCRIPT)
    p, w = start(tmp_path, ["-m", "mytrain", "0"])
    os.write(w, b"go\n")
    os.close(w)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert '"name": "__main__"' in out and "mytrain.py" in out, out


def test_a_closed_pipe_ends_the_standby_without_running_anything(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    p, w = start(tmp_path, ["train.py"])
    os.close(w)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert not marker.exists()
