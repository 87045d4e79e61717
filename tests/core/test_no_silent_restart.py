"""Never a silent step 0 (issue 35): when the job made progress (a flush log, step
directories, ``latest``) but nothing is loadable, ``restore_latest()`` says so at ERROR
before starting over, and ``require_resume`` (or CUDASNAP_REQUIRE_RESUME=1) refuses
instead. A fresh directory, or ``fresh=True``, starts at 0 quietly. The multi-rank case
(a step in one rank's memory only): tests/distributed/test_distributed.py."""
from __future__ import annotations

import logging

import pytest
import torch

import cudasnap
from cudasnap.errors import SnapshotError


def _job(snap_env, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, cudasnap.Snapshotter(model, opt, directory=snap_env.dir,
                                            job=snap_env.job, health=False, **kw)


def _train_and_flush(snap_env) -> None:
    model, opt, snap = _job(snap_env)
    for step in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        snap.boundary(step)
    snap.close()  # flushes step 2, removes the arena
    for data in snap_env.dir.glob("step-*/data.bin"):  # every copy damaged
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0xFF
        data.write_bytes(bytes(raw))


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_fresh_directory_starts_at_0_quietly(snap_env, caplog) -> None:
    _, _, snap = _job(snap_env)
    with caplog.at_level(logging.INFO, logger="cudasnap"):
        assert snap.restore_latest() == 0
    snap.close()
    assert _errors(caplog) == []


def test_progress_that_cannot_be_restored_is_an_error_or_refused(snap_env, caplog,
                                                                 monkeypatch) -> None:
    _train_and_flush(snap_env)
    _, _, snap = _job(snap_env)
    with caplog.at_level(logging.INFO, logger="cudasnap"):
        assert snap.restore_latest() == 0
    snap.close()
    said = [e for e in _errors(caplog) if "starting over at step 0" in e]
    assert said, caplog.text
    assert "flush-log.jsonl records 1 flush(es), the newest of step 2" in said[0]
    assert "step directories of step(s) 2" in said[0] and "'latest' names step-00000002" in said[0]

    _, _, snap = _job(snap_env, require_resume=True)
    with pytest.raises(SnapshotError, match=r"starting over at step 0.*require_resume"):
        snap.restore_latest()
    snap.close()
    monkeypatch.setenv("CUDASNAP_REQUIRE_RESUME", "1")
    _, _, snap = _job(snap_env)
    with pytest.raises(SnapshotError, match="refuses to start over"):
        snap.restore_latest()
    snap.close()
    _, _, snap = _job(snap_env, fresh=True)  # starting over on purpose
    assert snap.restore_latest() == 0
    snap.close()


@pytest.mark.slow
def test_cudasnap_run_says_in_its_summary_that_the_job_started_over(snap_env, tmp_path) -> None:
    """Issue 44 item 5: the attempt notes it (beside the supervisor's verdict file) and
    ``cudasnap run``'s summary says so at ERROR, where the job otherwise ends 0 in silence."""
    import subprocess
    import sys

    _train_and_flush(snap_env)
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, cudasnap\n"
        "m = torch.nn.Linear(4, 4); o = torch.optim.AdamW(m.parameters())\n"
        "s = cudasnap.Snapshotter(m, o, health=False)\n"
        "assert s.restore_latest() == 0\n"
        "s.close()\n")
    p = subprocess.run([sys.executable, "-m", "cudasnap", "run", "--dir", str(snap_env.dir),
                        "--no-warm", "--", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = [ln for ln in p.stderr.splitlines() if "cudasnap run: the job ended (exit 0), "
               "but an attempt started over at step 0" in ln]
    assert summary and "step directories of step(s) 2" in summary[0], p.stderr[-3000:]
