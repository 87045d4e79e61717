"""Object-store bad inputs (issue 23 item 5): a missing bucket is refused, never created;
an unreachable endpoint is one line and exit 2 for ``cudasnap inspect``/``verify``.

The S3 server is test_s3.py's (moto's standalone server on 127.0.0.1, dummy
credentials, nothing reaches AWS); ``cudasnap run --dir s3://`` is in
test_supervisor_edges.py (no server needed).
"""
# ruff: noqa: F811  (the fixtures imported from test_s3 are parameters here)
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

s3fs = pytest.importorskip("s3fs", reason="s3fs not installed (pip install 'cudasnap[s3]')")
pytest.importorskip("moto.server", reason="moto[server] not installed (requirements-dev.txt)")

from test_s3 import REPO, _fs, s3, s3_server, small_job  # noqa: E402,F401 - fixtures

import cudasnap  # noqa: E402
from cudasnap.errors import ConfigError  # noqa: E402


@pytest.mark.slow
def test_a_missing_bucket_is_refused_and_never_created(s3):
    """``directory="s3://nosuchbucket/p"``: ConfigError naming the bucket; no bucket made."""
    bucket = "nosuch-" + s3.removeprefix("s3://").split("/")[0]  # (the fixture made s3's)
    fs = _fs()
    assert not fs.exists(bucket)
    model, opt = small_job()
    with pytest.raises(ConfigError, match=f"bucket '{bucket}' does not exist"):
        cudasnap.Snapshotter(model, opt, directory=f"s3://{bucket}/p", backend="cpu",
                             flush_on_close=False)
    fs.invalidate_cache()
    assert not fs.exists(bucket), "a typo created a bucket"


def test_an_existing_bucket_still_works_with_a_new_prefix(s3):
    """The prefix below an existing bucket needs no creation: the flush lands there."""
    model, opt = small_job()
    snap = cudasnap.Snapshotter(model, opt, directory=s3, backend="cpu", flush_on_close=False)
    try:
        snap.boundary(0)
        snap.wait()
        assert str(snap.flush()) == f"{s3}/step-00000000"
    finally:
        snap.close()


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_an_unreachable_endpoint_is_one_line_and_exit_2(s3, monkeypatch, verb):
    """``cudasnap inspect s3://...`` with the endpoint down: one line naming the URL and
    the cause, exit 2 (documented in ``cudasnap --help``), no traceback."""
    import os

    env = dict(os.environ, CUDASNAP_S3_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "cudasnap", verb, s3], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert s3 in lines[0] and "connect" in lines[0].lower(), lines


def test_cli_help_documents_the_exit_status():
    from cudasnap.tools.cli import EXIT_STATUS

    assert "2 an error" in EXIT_STATUS and "object store" in EXIT_STATUS
