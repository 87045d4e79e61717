"""Supervisor (``cudasnap run``) fault cases for bench/faults.py (issue 14, items 2-7).

Each case runs real ``cudasnap run`` processes around tests/helpers/run_trainer.py
and reports a faultlib.Case: ``expected`` is the step the restarted attempt must
start at (or a count, named in the case), ``got`` what happened.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers.faultlib import Case, Ctx, _fill, guarded, mount_tmpfs, umount

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parent / "run_trainer.py"
STEPS = 8


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def _run(d: Path, stats: Path, *trainer: str, run_args: tuple[str, ...] = (),
         env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cudasnap", "run", "--dir", str(d), *run_args, "--",
           sys.executable, str(TRAINER), "--steps", str(STEPS), "--stats", str(stats), *trainer]
    return subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _starts(stats: Path) -> list[dict[str, Any]]:
    if not stats.exists():
        return []
    evs = [json.loads(ln) for ln in stats.read_text().splitlines() if ln.strip()]
    return [e for e in evs if e.get("ev") == "start"]


def _cleanup_arenas(ctx: Ctx, d: Path) -> None:
    from cudasnap.format import paths

    job = paths.job_for(d, create=False) if d.is_dir() else None
    for p in ctx.shm.glob(f"cudasnap-{job}-r*.arena") if job else []:
        p.unlink(missing_ok=True)


def _kill_restart(ctx: Ctx, case: Case) -> Case:
    """SIGKILL after step 5's optimizer step: resumed at 5 from shared memory, fast."""
    d, stats = ctx.dir("sup-kill"), ctx.root / f"{case.name}.jsonl"
    p = _run(d, stats, "--kill-at", "5", "--kill-phase", "post_opt", run_args=("--max-restarts",
                                                                               "1"))
    _cleanup_arenas(ctx, d)
    s = _starts(stats)
    case.got = s[1]["start"] if p.returncode == 0 and len(s) == 2 else None
    case.detail = f"rc {p.returncode}, restart gap {s[1]['t'] - s[0]['t']:.2f} s" \
        if len(s) == 2 and "t" in s[0] else f"rc {p.returncode}"
    return case


def _diskfull_orphan_flush(ctx: Ctx, case: Case) -> Case:
    """The directory's disk is full when the supervisor flushes: logged, arena kept,
    the restarted child resumes from shared memory."""
    fs = mount_tmpfs(ctx, "4m")
    if fs is None:
        case.expected, case.detail = None, "skipped: needs root (tmpfs)"
        return case
    try:
        d, stats = fs / "ckpt", ctx.root / f"{case.name}.jsonl"
        d.mkdir(mode=0o700)
        from cudasnap.format import paths

        paths.directory_id(d)
        _fill(fs, 64 << 10)  # room for the lock and id files, not for a snapshot
        p = _run(d, stats, "--kill-at", "5", "--kill-phase", "post_opt",
                 run_args=("--max-restarts", "1"))
        s = _starts(stats)
        case.got = s[1]["start"] if p.returncode == 0 and len(s) == 2 else None
        case.named = "could not flush step" in p.stderr and "No space" in p.stderr
        case.detail = f"rc {p.returncode}" + ("" if "Traceback" not in p.stderr else " TRACEBACK")
        _cleanup_arenas(ctx, d)
    finally:
        umount(fs)
        ctx.mounts.remove(fs)
    return case


def _two_runs_one_directory(ctx: Ctx, case: Case) -> Case:
    """A second ``cudasnap run`` on a busy directory stops (exit 2) and starts nothing;
    the first job completes untouched (got: 1 when both hold)."""
    d, stats = ctx.dir("sup-busy"), ctx.root / f"{case.name}.jsonl"
    stats2 = ctx.root / f"{case.name}-2.jsonl"
    first = subprocess.Popen(
        [sys.executable, "-m", "cudasnap", "run", "--dir", str(d), "--", sys.executable,
         str(TRAINER), "--steps", str(STEPS), "--stats", str(stats), "--sleep-per-step", "0.5"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _starts(stats) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        p = _run(d, stats2, "--kill-at", "1")
        rc1 = first.wait(300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    _cleanup_arenas(ctx, d)
    ok = p.returncode == 2 and not _starts(stats2) and rc1 == 0 and len(_starts(stats)) == 1
    case.got = 1 if ok else 0
    case.named = "in use by another job" in p.stderr
    case.detail = f"second rc {p.returncode}, first rc {rc1}"
    return case


def _deleted_directory(ctx: Ctx, case: Case) -> Case:
    """``rm -rf DIR`` after a crash: the next run starts at step 0, not from the orphan."""
    d, stats = ctx.dir("sup-rm"), ctx.root / f"{case.name}.jsonl"
    _run(d, stats, "--exit-hard")  # finishes, its arena stays in shared memory
    from cudasnap.format import paths

    old = paths.job_for(d, create=False)
    shutil.rmtree(d)
    stats2 = ctx.root / f"{case.name}-2.jsonl"
    p = _run(d, stats2)
    s = _starts(stats2)
    case.got = s[0]["start"] if s else None
    case.named = "not adopting staging arena" in p.stderr
    _cleanup_arenas(ctx, d)
    for q in ctx.shm.glob(f"cudasnap-{old}-r*.arena"):
        q.unlink(missing_ok=True)
    return case


def _clean_exit(ctx: Ctx, case: Case) -> Case:
    """A child that finished (exit 0) is not restarted (got: number of attempts)."""
    d, stats = ctx.dir("sup-done"), ctx.root / f"{case.name}.jsonl"
    p = _run(d, stats)
    _cleanup_arenas(ctx, d)
    case.got = len(_starts(stats)) if p.returncode == 0 else None
    return case


def supervisor_cases(ctx: Ctx) -> list[Case]:
    specs = [("kill_restart", 5, _kill_restart, False),
             ("diskfull_orphan_flush", 5, _diskfull_orphan_flush, True),
             ("two_runs_one_dir", 1, _two_runs_one_directory, True),
             ("deleted_dir_fresh", 0, _deleted_directory, True),
             ("clean_exit_not_restarted", 1, _clean_exit, False)]
    out = []
    for name, expected, fn, named in specs:
        case = Case("supervisor", name, expected, need_named=named)
        out.append(guarded(case, lambda c=case, f=fn: f(ctx, c)))  # type: ignore[misc]
    return out
