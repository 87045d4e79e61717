"""Fault matrix (bounded): every fault leaves a clear message, the previous good snapshot
loadable, and never a torn load. The cases live in tools/faults/matrix.py;
bench/faults.py runs the whole matrix with more seeds and prints the table.

Families: truncated/flipped/deleted snapshot files, flipped shared-memory slot
headers, a 2-rank layout with missing rank directories and COMMIT markers, a
full disk during flush (a small tmpfs, else RLIMIT_FSIZE), a staging tmpfs too
small, SIGKILL at every phase of copy and flush, two jobs on one directory; and one
case of each of issue 23's families (slow): ranks of different jobs, a too-small
/dev/shm under `cudasnap run`, a SIGSTOPped attempt, a group kill after a warm
restart, a late rank at the end of a 2-rank job.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from helpers import parts

from cudasnap._native import native
from cudasnap._testing import faults
from cudasnap.errors import (
    ConfigError,
    CorruptSnapshot,
    CudaError,
    FlushError,
    IncompatibleSnapshot,
    SnapshotError,
    StagingError,
)
from cudasnap.storage import posix
from tools.faults import matrix as F

SEED = int(os.environ.get("CUDASNAP_FAULT_SEED", "20261202"))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    c = F.Ctx(root=tmp_path_factory.mktemp("faults"), prefix=f"flt{uuid.uuid4().hex[:8]}")
    yield c
    c.cleanup()


@pytest.fixture(scope="module")
def disk_base(ctx):
    return F.build_base(ctx)


@pytest.fixture(scope="module")
def shm_base(ctx):
    return F.build_base(ctx, flush_steps=(0,), keep_arena=True)


@pytest.fixture(scope="module")
def zygote():
    z = F.Zygote()
    yield z
    z.close()


def _check(cases: list[F.Case], min_cases: int = 1) -> None:
    assert len(cases) >= min_cases
    bad = [c.line() for c in cases if not c.recovered]
    assert not bad, f"{len(bad)} of {len(cases)} cases failed:\n" + "\n".join(bad)
    assert not any(c.lost or c.torn for c in cases)


# ------------------------------------------------------------------- disk

def test_truncated_and_flipped_files_fall_back_to_the_previous_snapshot(ctx, disk_base):
    """>= 50 seeded truncations of data.bin / manifest.json at random offsets, 40 byte
    flips, and deletions of latest, files and step directories: every damaged newest
    snapshot is skipped with a warning naming the file; the one before loads bitwise."""
    cases = F.disk_cases(ctx, disk_base, n_trunc=60, n_flip=40, seed=SEED)
    assert sum(c.name.startswith("truncate") for c in cases) >= 50
    _check(cases, 100)


# -------------------------------------------------------------------- shm

def test_flipped_shared_memory_slots_fall_back(ctx, shm_base):
    """Flipped bytes in slot headers, meta, CRC tables, data and the arena header: the
    damaged slot is never loaded; the older slot (or disk) is."""
    _check(F.shm_cases(ctx, shm_base, n=20, seed=SEED), 20)


# ------------------------------------------------------------------- kill

@pytest.mark.slow
@pytest.mark.parametrize("phase", list(F.KILL_PHASES))
def test_sigkill_at_every_phase_of_copy_and_flush(ctx, zygote, phase):
    """A training process SIGKILLs itself (CUDASNAP_TEST_KILL_AT) while step 2 is being
    copied or flushed: restart restores the expected step (from memory and from disk
    alone), bitwise, and no .tmp directory survives the restart."""
    _check(F.kill_cases(ctx, zygote, [phase], replace=False), 1)


def test_sigkill_while_replacing_a_committed_copy_keeps_it(ctx, zygote):
    _check(F.kill_cases(ctx, zygote, [], replace=True), 1)


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_clean_partial_brings_back_a_moved_aside_copy(tmp_path):
    d = posix.check_directory(tmp_path / "ckpt")
    dead = _dead_pid()
    (d / f"step-00000007.old-{dead}").mkdir()
    (d / f"step-00000007.old-{dead}" / "manifest.json").write_text("{}")
    (d / f"step-00000007.tmp-{dead}").mkdir()
    (d / f".latest.tmp-{dead}").write_text("x")
    removed = posix.clean_partial(d)
    assert [p.name for p in removed] == [f"step-00000007.tmp-{dead}"]
    assert (d / "step-00000007" / "manifest.json").exists()
    assert not (d / f".latest.tmp-{dead}").exists()
    # When the new copy did arrive, the old one is just removed.
    (d / f"step-00000007.old-{dead}").mkdir()
    assert [p.name for p in posix.clean_partial(d)] == [f"step-00000007.old-{dead}"]


def test_clean_partial_leaves_a_live_writers_flush_alone(tmp_path):
    """The restarted attempt's constructor runs while ``cudasnap run`` still flushes the
    dead attempt's arena (warm restart: 0.06 s after the death): the supervisor's
    ``.tmp-<pid>`` must survive; a dead writer's goes, also when its pid was reused by a
    process started later."""
    import subprocess
    import time

    d = posix.check_directory(tmp_path / "ckpt")
    live = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.05)
        ours = d / f"step-00000008.tmp-{live.pid}"
        ours.mkdir()
        (d / f".latest.tmp-{live.pid}").write_text("x")
        dead = d / f"step-00000007.tmp-{_dead_pid()}"
        dead.mkdir()
        assert posix.clean_partial(d) == [dead]
        assert ours.is_dir() and (d / f".latest.tmp-{live.pid}").exists()
        old = time.time() - 3600  # written an hour before the process with that pid started
        os.utime(ours, (old, old))
        assert posix.clean_partial(d) == [ours]
    finally:
        live.kill()
        live.wait()


def test_kill_hook_is_inert_unless_asked(monkeypatch):
    monkeypatch.delenv(faults.KILL_ENV, raising=False)
    faults.kill_point("rename")  # returns: the process is still alive
    monkeypatch.setenv(faults.KILL_ENV, "latest@5")
    faults.kill_point("rename")  # another phase


# --------------------------------------------------------------- disk full

@pytest.mark.parametrize("what", ["data", "manifest", "latest"])
def test_disk_full_during_flush(ctx, what):
    """8 MiB tmpfs as the snapshot directory (RLIMIT_FSIZE where mount is not allowed):
    data.bin, the manifest or `latest` does not fit. flush() raises FlushError naming
    the file and ENOSPC, no .tmp is left, `latest` and the previous snapshot are intact,
    a trigger's flush failing does not stop training, and after space is freed the next
    flush works."""
    mode = "tmpfs" if _can_mount(ctx) else "rlimit"
    if mode == "rlimit" and what != "data":
        pytest.skip("only the data case can be simulated with RLIMIT_FSIZE")
    case = F.Case("diskfull", what, 0 if what != "latest" else 1)
    _check([F.guarded(case, lambda: F.diskfull_case(ctx, what, mode, case))])


def _can_mount(ctx) -> bool:
    d = F.mount_tmpfs(ctx, "64k")
    if d is None:
        return False
    F.umount(d)
    ctx.mounts.remove(d)
    return True


@pytest.mark.parametrize("what", ["tiny", "full", "env"])
def test_staging_dir_too_small_is_refused_with_sizes(ctx, what):
    if not _can_mount(ctx):
        pytest.skip("needs mount -t tmpfs (root)")
    case = F.Case("shmfull", what, None)
    _check([F.guarded(case, lambda: F.shmfull_case(ctx, what, case))])


# ------------------------------------------------------------------- lock

def test_two_jobs_on_one_directory_and_a_dead_jobs_lock(ctx):
    _check(F.lock_cases(ctx), 2)


# ------------------------------------------------------------ distributed

@pytest.mark.slow
def test_distributed_layout_faults(ctx):
    """DIR/step-N/rank-RRRRR/ + COMMIT restored by two gloo ranks: a missing COMMIT, a
    missing rank directory (sharded and replicated), damaged rank files."""
    _check(F.dist_cases(ctx), len(F.DIST_CASES))


# ----------------------------------------------------------------- errors

KINDS = [(0, SnapshotError), (1, StagingError), (2, CorruptSnapshot), (3, IncompatibleSnapshot),
         (4, FlushError), (5, CudaError)]


@pytest.mark.parametrize("kind,cls", KINDS)
def test_cpp_errors_map_to_the_hierarchy_with_file_and_line(kind, cls):
    with pytest.raises(cls) as ei:
        parts.raise_native(native(), kind, f"boom {kind}")
    assert type(ei.value) is cls and isinstance(ei.value, SnapshotError)
    msg = str(ei.value)
    assert f"boom {kind}" in msg and "[check: false]" in msg
    assert "bindings.cpp:" in msg  # (file:line) of the failing check


def test_hierarchy():
    for cls in (CorruptSnapshot, IncompatibleSnapshot, StagingError, FlushError, CudaError,
                ConfigError):
        assert issubclass(cls, SnapshotError)
    assert issubclass(ConfigError, ValueError)


def test_a_real_cpp_failure_names_file_line_and_call(tmp_path):
    C = native()
    with pytest.raises(StagingError) as ei:
        C.Arena.open(str(tmp_path / "nope.arena"), True)
    msg = str(ei.value)
    assert str(tmp_path / "nope.arena") in msg and "No such file" in msg
    assert "open(" in msg or "::open" in msg  # the failing call
    assert "staging_file.cpp:" in msg  # the file and line of the check
    with pytest.raises(FlushError) as ei:
        C.fsync_dir(str(tmp_path / "missing-dir"))
    assert "flusher.cpp:" in str(ei.value) and "missing-dir" in str(ei.value)
    assert Path(tmp_path).exists()


# ------------------------------------------- issue 23: one case of each new family

@pytest.mark.slow
def test_ranks_of_different_jobs_fail_with_a_config_error_naming_both(ctx):
    """jobmismatch: 2 gloo ranks restoring with different CUDASNAP_JOB both exit non-zero
    with a ConfigError naming both jobs (bound: a failure guard, not a timing)."""
    from tools.faults.endjob import jobmismatch_cases

    _check(jobmismatch_cases(ctx, bound_s=120.0, names=("fresh directory",)), 1)


@pytest.mark.slow
def test_a_too_small_shm_under_cudasnap_run_is_one_attempt(ctx):
    """config: CUDASNAP_SHM_DIR a 64 KiB tmpfs under `cudasnap run`: exit 1, one attempt."""
    from tools.faults.supervisor import config_cases

    if not _can_mount(ctx):
        pytest.skip("needs mount -t tmpfs (root)")
    _check(config_cases(ctx), 1)


@pytest.mark.slow
def test_a_sigstopped_attempt_is_restarted_and_ends_bitwise(ctx):
    """stop: SIGSTOP after boundary 3 under --watchdog 2: restarted at 4, bitwise."""
    from tools.faults.supervisor import stop_cases

    _check(stop_cases(ctx), 1)


@pytest.mark.slow
def test_a_group_kill_after_a_warm_restart_leaves_nothing_and_the_next_run_resumes(ctx):
    """escape: `kill -9 -- -PGID` of `cudasnap run` after a warm restart: no survivor; the
    next run resumes at the newest COMPLETE step + 1 and ends bitwise."""
    from tools.faults.supervisor import escape_cases

    _check(escape_cases(ctx, names=("group kill after a warm restart",)), 1)


@pytest.mark.slow
def test_a_gated_late_rank_ends_the_job_without_a_restart(ctx):
    """endjob: rank 0 late to its last boundary (gated on the others' flush round), plain:
    exit 0, no restart, `latest` = the last step (no bound on the flush's duration here:
    tests/distributed/test_end_of_job.py has it)."""
    from tools.faults.endjob import STEPS, endjob_torchrun

    case = F.Case("endjob", "gated late rank 0, plain", STEPS - 1, need_named=False)
    _check([F.guarded(case, lambda: endjob_torchrun(
        ctx, case, env={"MODE": "plain", "LATE_S": "0.5"}, late_rank=0, scenario="late",
        gated=True, bound_s=float("inf")))], 1)
