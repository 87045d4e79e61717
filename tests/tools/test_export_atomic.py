"""`cudasnap export` never tears its target (issue 23 item 4): a kill mid-export leaves the
previous export whole; targets inside the snapshot directory and impossible targets are
refused with one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cudasnap
from cudasnap.errors import ConfigError
from cudasnap.tools.cli import main
from cudasnap.tools.export import export_safetensors, export_torch

REPO = Path(__file__).resolve().parents[2]


def _snapshot(tmp: Path, steps: int) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    snap = cudasnap.Snapshotter(model, opt, directory=tmp / "ckpt", backend="cpu", keep=0)
    for step in range(steps):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snap.boundary(step)
        snap.flush()  # every step on disk (exports of steps 1 and 2)
    snap.close()
    return tmp / "ckpt"


# The child exports step 2 over the step-1 export; its writer writes half the bytes, says
# so on stdout and waits to be killed (the kill lands mid-write, no timing involved).
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    fmt, ckpt, target = sys.argv[1:4]
    def stall(path, n=64):
        with open(path, "wb") as f:
            f.write(b"x" * n); f.flush()
        print("writing", flush=True)
        time.sleep(600)
    if fmt == "torch":
        import torch
        torch.save = lambda obj, path: stall(path)
        from cudasnap.tools.export import export_torch
        export_torch(Path(ckpt), Path(target), step=2)
    else:
        import safetensors.torch as st
        st.save_file = lambda tensors, path, metadata=None: stall(path)
        from cudasnap.tools.export import export_safetensors
        export_safetensors(Path(ckpt), Path(target), step=2)
""")


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_kill_mid_export_keeps_the_previous_export(tmp_path: Path, fmt: str) -> None:
    ckpt = _snapshot(tmp_path, 3)
    target = tmp_path / ("out.pt" if fmt == "torch" else "out.safetensors")
    export = export_torch if fmt == "torch" else export_safetensors
    export(ckpt, target, step=1)
    before = target.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", CHILD, fmt, str(ckpt), str(target)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    assert target.read_bytes() == before  # untouched: the torn bytes are in a temp file
    if fmt == "torch":
        assert torch.load(target, weights_only=True)["step"] == 1
    export(ckpt, target, step=2)  # the next export replaces it and removes the dead temp
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert (target.stat().st_mode & 0o777) == 0o600


def test_export_refuses_targets_inside_the_snapshot_directory(tmp_path: Path) -> None:
    ckpt = _snapshot(tmp_path, 1)
    log = ckpt / "flush-log.jsonl"
    before = log.read_bytes() if log.exists() else None
    for target in (ckpt / "flush-log.jsonl", ckpt / "latest", ckpt / "mine.pt"):
        with pytest.raises(ConfigError, match="inside the snapshot directory"):
            export_torch(ckpt, target)
    assert (log.read_bytes() if log.exists() else None) == before
    with pytest.raises(ConfigError, match="inside the snapshot directory"):
        export_safetensors(ckpt, ckpt / "hf")


def test_export_to_a_missing_directory_is_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """(It was a raw SafetensorError traceback, exit 1.)"""
    ckpt = _snapshot(tmp_path, 1)
    for fmt, target in (("safetensors", "/no/such/dir/out"),
                        ("safetensors", "/no/such/dir/out.safetensors"),
                        ("torch", "/no/such/dir/out.pt")):
        rc = main(["export", str(ckpt), "--to", fmt, target])
        err = capsys.readouterr().err
        assert rc != 0 and "does not exist" in err and "Traceback" not in err, (fmt, target, err)
    assert not os.path.exists("/no/such")
