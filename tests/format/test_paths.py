"""cudasnap.format.paths: the job id is derived in one place (issue 12)."""
from __future__ import annotations

import re

import pytest

from cudasnap.errors import ConfigError
from cudasnap.format import paths


def test_job_id_creates_the_directory_id_once_and_is_stable(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    assert paths.job_for(d, create=False) is None
    job = paths.job_id(d)
    assert re.fullmatch(r"[0-9a-f]{16}", job)
    assert (d / paths.ID_FILE).stat().st_mode & 0o777 == 0o600
    assert paths.job_id(str(d)) == job == paths.job_for(d, create=False) == paths.job_for(d)
    assert paths.snapshotter_job(d, tmp_path / "shm") == job


def test_job_id_changes_with_the_directory_identity_not_only_its_path(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    old = paths.job_id(d)
    assert paths.renew_id(d) and paths.job_id(d) != old
    assert paths.job_id(d)[:8] == old[:8]  # same path hash: stale_arenas finds the old ones
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / paths.arena_name(old, 0)).touch()
    assert paths.stale_arenas(d, paths.job_id(d), shm) == [shm / paths.arena_name(old, 0)]


def test_job_id_of_a_url_is_refused():
    with pytest.raises(ConfigError, match="s3://b/p.*local state directory"):
        paths.job_id("s3://b/p")


def test_no_module_but_paths_derives_the_job_id():
    """The hash recipe (sha1 of the realpath + of the id) lives in format/paths.py only."""
    from pathlib import Path

    pkg = Path(paths.__file__).resolve().parents[1]
    # An object-store directory keeps its id file in the store so every node derives the
    # same job: these two only copy the file between the store and the local state
    # directory (reviewed), they never hash anything.
    copiers = {"storage/fsspec.py", "storage/remote_latest.py"}
    others = [str(f.relative_to(pkg)) for f in pkg.rglob("*.py")
              if f.name != "paths.py" and ("ID_FILE" in f.read_text() or "def job_for" in f.read_text())]
    assert sorted(set(others) - copiers) == []
    for name in copiers:
        text = (pkg / name).read_text()
        assert "hashlib" not in text and "sha1" not in text and "def job_for" not in text, name
