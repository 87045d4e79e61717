"""``latest`` never moves back to an older step (issue 14: the supervisor's orphan flush of the
dead attempt's step 4 ended after the restarted attempt had flushed step 7, and pointed
``latest`` at step 4: ``cudasnap inspect`` and ``export DIR/latest`` then showed the old step)."""
from __future__ import annotations

import random
import threading

from cudasnap.format import paths
from cudasnap.storage import latest, posix


def _steps(d, *steps):
    for s in steps:
        (d / paths.step_dirname(s)).mkdir()


def test_an_older_step_flushed_last_does_not_move_latest_back(tmp_path):
    d = posix.check_directory(tmp_path / "ckpt")
    _steps(d, 4, 7)
    assert posix.replace_latest(d, paths.step_dirname(7))
    assert not posix.replace_latest(d, paths.step_dirname(4))
    assert latest.read_latest(d) == paths.step_dirname(7)
    # A newer one moves it on; once the step it names is gone (moved aside by a fresh
    # start), an older one may take its place.
    _steps(d, 9)
    assert posix.replace_latest(d, paths.step_dirname(9))
    (d / paths.step_dirname(9)).rename(d / "aside")
    assert posix.replace_latest(d, paths.step_dirname(4))
    assert latest.read_latest(d) == paths.step_dirname(4)
    assert (d / latest.LATEST_LOCK).stat().st_mode & 0o777 == 0o600


def test_writers_racing_leave_latest_at_the_newest_step(tmp_path):
    d = posix.check_directory(tmp_path / "ckpt")
    steps = list(range(40))
    _steps(d, *steps)
    random.Random(7).shuffle(steps)
    go = threading.Barrier(4)

    def writer(mine):
        go.wait()
        for s in mine:
            posix.replace_latest(d, paths.step_dirname(s))

    threads = [threading.Thread(target=writer, args=(steps[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert latest.read_latest(d) == paths.step_dirname(39)


def test_the_flush_timeout_bounds_the_wait_for_the_latest_lock(snap_env, caplog):
    """``Snapshotter.flush(timeout=T)`` reaches the storage write: with ``DIR/.latest-lock``
    held by another writer, the flush still commits its step and returns within about T,
    leaving ``latest`` as it was (logged); without a timeout it waits for the lock."""
    import fcntl
    import os
    import time

    import torch

    import cudasnap

    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with cudasnap.Snapshotter(m, opt, snap_env.dir, backend="cpu", flush_on_close=False) as snap:
        snap.boundary(0)
        assert snap.flush(timeout=30) is not None
        assert latest.read_latest(snap.directory) == paths.step_dirname(0)
        snap.boundary(1)
        fd = os.open(snap.directory / ".latest-lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another writer (an own fd: flock is per open file)
            t0 = time.monotonic()
            path = snap.flush(timeout=0.5)
            secs = time.monotonic() - t0
            assert path is not None and (path / "manifest.json").is_file()  # committed
            assert latest.read_latest(snap.directory) == paths.step_dirname(0)  # left as it was
            assert secs < 10, secs
            assert "stayed locked by another writer" in caplog.text

            snap.boundary(2)
            done = threading.Event()
            t = threading.Thread(target=lambda: (snap.flush(timeout=None), done.set()))
            t.start()
            assert not done.wait(1.0)  # no bound: it waits for the lock
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        t.join(60)
        assert done.is_set() and latest.read_latest(snap.directory) == paths.step_dirname(2)
