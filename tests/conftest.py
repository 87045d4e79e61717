"""Shared pytest setup for cudasnap's tests.

* puts the repository root on sys.path (the package is used in place, built with
  ``setup.py build_ext --inplace``);
* registers the ``gpu`` and ``slow`` markers (``gpu`` tests skip without a CUDA device);
* ``snap_env``: a unique job / shared-memory arena name and a fresh snapshot
  directory per test; arena files of that job are removed afterwards.
"""
from __future__ import annotations

import itertools
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHM = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
# Every boundary copies unless a test says otherwise: most tests count snapshots per
# boundary. The default (a 1% overhead budget picking the cadence) is tested where it
# is the subject (tests/core/test_cadence.py, tests/e2e/test_budget_default.py) and
# passed there explicitly; subprocesses inherit this.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")
_RUN = uuid.uuid4().hex[:6]
_counter = itertools.count()


# tests/cuda_emu runs in its own process under the emulated CUDA runtime
# (tools/cudaemu/run.sh; `make test` does both lanes): not collected here.
collect_ignore = [] if os.environ.get("CUDASNAP_EMULATED_CUDA") == "1" else ["cuda_emu"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: over ~1.5 s on 2 cores (left out of make test-fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        have_gpu = False
    if have_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@dataclass
class SnapEnv:
    """Names and places of one test (see ``snap_env``)."""

    job: str  # unique per test; also exported as CUDASNAP_JOB
    dir: Path  # a fresh snapshot directory (not created yet)
    tmp: Path  # the test's tmp_path
    shm: Path = SHM

    def arena_path(self, rank: int = 0, job: str | None = None) -> Path:
        """Where a Snapshotter of this job (or of ``job``) keeps its arena."""
        return self.shm / f"cudasnap-{job or self.job}-r{rank}.arena"

    def scratch_arena(self, name: str) -> Path:
        """An arena file name of this test for direct Arena tests (cleaned up too)."""
        return self.shm / f"cudasnap-{self.job}-{name}.arena"

    def sub_job(self, name: str) -> str:
        """A job name derived from this test's (its arena files are cleaned up too)."""
        return f"{self.job}-{name}"

    def arena_files(self) -> list[Path]:
        return sorted(self.shm.glob(f"cudasnap-{self.job}*"))


@pytest.fixture
def snap_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    job = f"t{_RUN}-{os.getpid()}-{next(_counter)}"
    monkeypatch.setenv("CUDASNAP_JOB", job)
    monkeypatch.delenv("CUDASNAP_HEALTH", raising=False)
    monkeypatch.delenv("CUDASNAP_SHM_DIR", raising=False)
    env = SnapEnv(job=job, dir=tmp_path / "ckpt", tmp=tmp_path)
    yield env
    # Only this test's files: other engineers run suites on the same machine.
    for p in SHM.glob(f"cudasnap-{job}*"):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


@pytest.fixture(scope="session")
def native_C():
    """The compiled engine (skips everything that needs it when it is not built)."""
    try:
        from cudasnap._native import native

        return native()
    except Exception as e:  # pragma: no cover - unbuilt tree
        pytest.fail(f"cudasnap._C is not usable: {e}; run `python setup.py build_ext --inplace`")
