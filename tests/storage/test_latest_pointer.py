"""``latest`` never moves back to an older step (issue 14: the supervisor's orphan flush of the
dead attempt's step 4 ended after the restarted attempt had flushed step 7, and pointed
``latest`` at step 4: ``cudasnap inspect`` and ``export DIR/latest`` then showed the old step)."""
from __future__ import annotations

import random
import threading

from cudasnap.format import paths
from cudasnap.storage import posix


def _steps(d, *steps):
    for s in steps:
        (d / paths.step_dirname(s)).mkdir()


def test_an_older_step_flushed_last_does_not_move_latest_back(tmp_path):
    d = posix.check_directory(tmp_path / "ckpt")
    _steps(d, 4, 7)
    assert posix.replace_latest(d, paths.step_dirname(7))
    assert not posix.replace_latest(d, paths.step_dirname(4))
    assert posix.read_latest(d) == paths.step_dirname(7)
    # A newer one moves it on; once the step it names is gone (moved aside by a fresh
    # start), an older one may take its place.
    _steps(d, 9)
    assert posix.replace_latest(d, paths.step_dirname(9))
    (d / paths.step_dirname(9)).rename(d / "aside")
    assert posix.replace_latest(d, paths.step_dirname(4))
    assert posix.read_latest(d) == paths.step_dirname(4)
    assert (d / posix.LATEST_LOCK).stat().st_mode & 0o777 == 0o600


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
    assert posix.read_latest(d) == paths.step_dirname(39)
