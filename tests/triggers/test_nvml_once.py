"""'NVML unavailable' is said once per job, and at INFO where no GPU is in use (issue 26).

Before, every process of a job said it at WARNING: on a CPU machine each start of
every child under ``cudasnap run`` (the demo printed it twice), each rank, each
restart. Now the first process of the job (rank 0 of the first attempt) says it
once, a WARNING only when CUDA devices are in use; restarts and other ranks at DEBUG.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import parts
from helpers.triggers import clean_trigger_env  # noqa: F401 (autouse fixture)

from cudasnap.config import Settings
from cudasnap.triggers import nvml as _nvml
from cudasnap.triggers.monitor import HealthMonitor
from cudasnap.triggers.nvml import NvmlSession

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(_nvml, "pynvml", None)  # init() fails: "pynvml ... not installed"
    for name in ("CUDASNAP_RESTART", "TORCHELASTIC_RESTART_COUNT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.DEBUG, logger="cudasnap.health")
    return caplog


def _said(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [r.levelno for r in caplog.records if "NVML unavailable" in r.getMessage()]


def test_no_gpu_in_use_info_once(no_nvml: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    parts.replace_cuda_in_use(monkeypatch, lambda: False)
    for _ in range(3):
        assert not NvmlSession().available
    HealthMonitor(lambda t: None).start()
    assert _said(no_nvml) == [logging.INFO] + [logging.DEBUG] * 3


def test_cuda_devices_in_use_warning_once(no_nvml: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    parts.replace_cuda_in_use(monkeypatch, lambda: True)
    NvmlSession()
    NvmlSession()
    assert _said(no_nvml) == [logging.WARNING, logging.DEBUG]


@pytest.mark.parametrize("var", ["CUDASNAP_RESTART", "TORCHELASTIC_RESTART_COUNT", "RANK"])
def test_restarts_and_other_ranks_stay_quiet(var: str, no_nvml: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    parts.replace_cuda_in_use(monkeypatch, lambda: True)  # even where a WARNING would be due
    monkeypatch.setenv(var, "1")
    first = Settings.from_env().first_of_job  # the entry point's (HealthOptions.first_of_job)
    assert first is False
    NvmlSession(first_of_job=first)
    assert _said(no_nvml) == [logging.DEBUG]


def test_cuda_in_use_is_false_on_a_cpu_only_process() -> None:
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present on this machine")
    assert parts.cuda_in_use() is False


@pytest.mark.slow
def test_demo_on_a_cpu_machine_prints_no_nvml_line(tmp_path: Path) -> None:
    """The demo (a supervised child, killed, restarted) logs at WARNING: on a CPU machine
    it printed 'NVML unavailable' at each start of each child; now nothing."""
    if _nvml.init() is None:
        _nvml.shutdown()
        pytest.skip("a real NVML driver is present")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA driver is present: the line is a WARNING there")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("CUDASNAP_DIR", "CUDASNAP_JOB", "CUDASNAP_RESTART", "RANK", "CUDASNAP_INJECT"):
        env.pop(name, None)
    p = subprocess.run([sys.executable, "-m", "cudasnap", "demo", "--steps", "12", "--fail-at", "7",
                        "--hidden", "64", "--layers", "2", "--device", "cpu", "--workdir", str(tmp_path / "d")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "bitwise identical : True" in out, out[-3000:]
    assert "NVML unavailable" not in out, out[-3000:]
