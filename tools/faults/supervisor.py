"""Supervisor (``cudasnap run``) fault cases for bench/faults.py (issue 14, items 1-7).

Each case runs real ``cudasnap run`` processes around tools/faults/run_trainer.py
and reports a matrix.Case: ``expected`` is the step the restarted attempt must
start at (or a count, named in the case), ``got`` what happened.

``negative`` (bench/faults.py --negative) runs the cases of items 1 and 2 with the
trainer's Snapshotter set back to the behaviour before the fix (no spare slot, no
flush on close) and item 7's with a supervisor that flushes before it restarts:
those cases must then report LOST, which shows they can fail.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.faults.matrix import Case, Ctx, fill, guarded, mount_tmpfs, umount

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parent / "run_trainer.py"
STEPS = 8


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


# ``cudasnap run`` whose orphan flush (posix.write_slot) first sleeps argv[1] seconds: a
# large state or a slow disk, in a real supervisor process (item 7). argv[2] "sync": the
# negative control, a supervisor that finishes that flush before it restarts (pre-fix).
_SLOW_FLUSH_RUN = """import sys, threading, time, types
from cudasnap.storage import posix
from cudasnap.supervisor import loop, run
real = posix.write_slot
def slow(*a, **k):
    time.sleep(float(sys.argv[1]))
    return real(*a, **k)
posix.write_slot = slow
class FlushFirst(threading.Thread):
    def start(self):
        super().start()
        if self.name == "cudasnap-orphan-flush":
            self.join()
if sys.argv[2] == "sync":
    loop.threading = types.SimpleNamespace(**{**vars(threading), "Thread": FlushFirst})
sys.exit(run.main(sys.argv[3:]))
"""


def _run(d: Path, stats: Path, *trainer: str, run_args: tuple[str, ...] = (),
         env: dict[str, str] | None = None, timeout: float = 300,
         supervisor: tuple[str, ...] = ("-m", "cudasnap", "run")) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *supervisor, "--dir", str(d), *run_args, "--",
           sys.executable, str(TRAINER), "--steps", str(STEPS), "--stats", str(stats), *trainer]
    return subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _events(stats: Path, ev: str | None = None) -> list[dict[str, Any]]:
    if not stats.exists():
        return []
    evs = [json.loads(ln) for ln in stats.read_text().splitlines() if ln.strip()]
    return [e for e in evs if ev is None or e.get("ev") == ev]


def _starts(stats: Path) -> list[dict[str, Any]]:
    return _events(stats, "start")


def _log_time(stderr: str, text: str) -> float | None:
    """Wall-clock time of the first ``cudasnap run`` log line containing ``text``."""
    for line in stderr.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) cudasnap-run ", line)
        if m and text in line:
            return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + \
                int(m.group(2)) / 1000
    return None


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
    s, kills = _starts(stats), _events(stats, "kill")
    case.got = s[1]["start"] if p.returncode == 0 and len(s) == 2 else None
    case.detail = f"rc {p.returncode}" + (
        f", death -> resumed child running {s[1]['t'] - kills[0]['t']:.2f} s"
        if len(s) == 2 and len(kills) == 1 else "")
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
        fill(fs, 64 << 10)  # room for the lock and id files, not for a snapshot
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


def _resumed(p: subprocess.CompletedProcess[str], stats: Path, attempts: int = 2
             ) -> tuple[int | None, str]:
    """(step the second attempt started at, its restore source) when the run ended 0
    after exactly ``attempts`` attempts (a finished child restarted shows one more)."""
    s = _starts(stats)
    if p.returncode != 0 or len(s) != attempts:
        return None, f"rc {p.returncode}, {len(s)} attempt(s)"
    src = (s[1].get("restore") or {}).get("source")
    return s[1]["start"], f"resumed from {src}"


def _long_flush(ctx: Ctx, case: Case, *, after: bool, negative: bool) -> Case:
    """Item 1: a flush started after step 2 stays in progress (slot leased) until
    boundary(5) is done while training goes on (0.3 s a step). SIGKILL during it (step
    5, after its optimizer step) or right after it ended (step 6): the restarted child
    starts at the killed step, replaying at most that one step."""
    d, stats = ctx.dir("sup-flush"), ctx.root / f"{case.name}.jsonl"
    kill = ("--kill-after-flush",) if after else ("--kill-at", "5", "--kill-phase", "post_opt")
    p = _run(d, stats, "--flush-at", "2", "--flush-steps", "3", "--sleep-per-step", "0.3",
             *kill, *(("--no-spare-slot",) if negative else ()), run_args=("--max-restarts", "1"))
    _cleanup_arenas(ctx, d)
    kills, fl = _events(stats, "kill"), _events(stats, "flush_start")
    done = _events(stats, "flush_done")
    if len(kills) != 1 or not fl or kills[0]["flushing"] is after or bool(done) is not after:
        raise AssertionError(f"not the fault asked for: kill {kills}, flush {fl} {done}")
    case.got, how = _resumed(p, stats)
    flush_s = (done[0]["t"] if done else kills[0]["t"]) - fl[0]["t"]
    when = (f"{kills[0]['t'] - done[0]['t']:.2f} s after the end of a {flush_s:.2f} s flush"
            if done else f"during a flush running for {flush_s:.2f} s")
    case.detail = f"killed at step {kills[0]['step']} {when}; {how}"
    return case


def _close_then_kill(ctx: Ctx, case: Case, *, negative: bool) -> Case:
    """Item 2: SIGKILL right after ``snap.close()`` (which flushes the final step): the
    restarted child starts at STEPS from disk (not 0), finishes, and is not restarted
    again (``--max-restarts 3``: got None when a third attempt ran)."""
    d, stats = ctx.dir("sup-close"), ctx.root / f"{case.name}.jsonl"
    p = _run(d, stats, "--kill-after-close", *(("--no-close-flush",) if negative else ()),
             run_args=("--max-restarts", "3"))
    _cleanup_arenas(ctx, d)
    kills = _events(stats, "kill")
    if len(kills) != 1 or kills[0]["phase"] != "after_close":
        raise AssertionError(f"not the fault asked for: kill {kills}")
    case.got, how = _resumed(p, stats)
    case.detail = f"{how}; attempts: {len(_starts(stats))}"
    return case


SLOW_ORPHAN_FLUSH_S = 3.0


def _orphan_flush_beside_restart(ctx: Ctx, case: Case, negative: bool = False) -> Case:
    """Item 7: the supervisor's flush of the dead child's slot takes 3 s (slowed in the
    ``cudasnap run`` process). The restart must begin < 0.5 s after the SIGKILL, the flush
    end more than 2.5 s after that restart (it ran beside it, not before it), the new
    child resume at step 5 from shared memory and step 4 reach the disk (got 1: all hold)."""
    from cudasnap.storage.latest import read_latest

    d, stats = ctx.dir("sup-beside"), ctx.root / f"{case.name}.jsonl"
    p = _run(d, stats, "--kill-at", "5", "--kill-phase", "post_opt",
             run_args=("--max-restarts", "1"),
             supervisor=("-c", _SLOW_FLUSH_RUN, str(SLOW_ORPHAN_FLUSH_S),
                         "sync" if negative else "beside"))
    _cleanup_arenas(ctx, d)
    from cudasnap.format import paths
    from cudasnap.storage import posix

    kills, s = _events(stats, "kill"), _starts(stats)
    restart = _log_time(p.stderr, "restarting (restart 1 of 1)")
    flushed = _log_time(p.stderr, "flushed step 4 left in")
    start, how = _resumed(p, stats)
    if len(kills) != 1 or restart is None or flushed is None or start is None:
        case.got, case.detail = 0, f"{how}; kill {kills}, restart {restart}, flushed {flushed}"
        return case
    to_restart, beside = restart - kills[0]["t"], flushed - restart
    steps = [x.step for x in posix.list_snapshots(d)]
    on_disk, latest = 4 in steps, read_latest(d)
    # `latest` names the newest step on disk, although the flush of step 4 ended last.
    newest = paths.step_dirname(max(steps)) if steps else None
    ok = (to_restart < 0.5 and beside > SLOW_ORPHAN_FLUSH_S - 0.5 and start == 5
          and how == "resumed from shm" and on_disk and latest == newest)
    case.got = 1 if ok else 0
    case.detail = (f"death -> restart {to_restart:.2f} s, orphan flush ended {beside:.2f} s "
                   f"after the restart, new child running (step {start}, {how[13:]}) "
                   f"{s[1]['t'] - kills[0]['t']:.2f} s after the death; step 4 on disk: "
                   f"{on_disk} (on disk: {steps}, latest: {latest})")
    return case


def supervisor_cases(ctx: Ctx, negative: bool = False) -> list[Case]:
    if negative:  # items 1, 2 (pre-fix Snapshotter), 7 (pre-fix supervisor): each LOST
        neg = [("long_flush_kill_during", 5, lambda c: _long_flush(ctx, c, after=False,
                                                                   negative=True)),
               ("long_flush_kill_after", 6, lambda c: _long_flush(ctx, c, after=True,
                                                                  negative=True)),
               ("close_then_kill", STEPS, lambda c: _close_then_kill(ctx, c, negative=True)),
               ("orphan_flush_beside_restart", 1,
                lambda c: _orphan_flush_beside_restart(ctx, c, negative=True))]
        return [guarded(c, lambda c=c, f=f: f(c))  # type: ignore[misc]
                for c, f in ((Case("supervisor-negative", n, e, need_named=False), f)
                             for n, e, f in neg)]
    specs = [("kill_restart", 5, _kill_restart, False),
             ("diskfull_orphan_flush", 5, _diskfull_orphan_flush, True),
             ("two_runs_one_dir", 1, _two_runs_one_directory, True),
             ("deleted_dir_fresh", 0, _deleted_directory, True),
             ("clean_exit_not_restarted", 1, _clean_exit, False),
             ("long_flush_kill_during", 5,
              lambda x, c: _long_flush(x, c, after=False, negative=False), False),
             ("long_flush_kill_after", 6,
              lambda x, c: _long_flush(x, c, after=True, negative=False), False),
             ("close_then_kill", STEPS,
              lambda x, c: _close_then_kill(x, c, negative=False), False),
             ("orphan_flush_beside_restart", 1, _orphan_flush_beside_restart, False)]
    out = []
    for name, expected, fn, named in specs:
        case = Case("supervisor", name, expected, need_named=named)
        out.append(guarded(case, lambda c=case, f=fn: f(ctx, c)))  # type: ignore[misc]
    return out


# ------------------------------------------------ issue 23: escape, config, stop

def _reference(ctx: Ctx) -> dict[str, Any]:
    """The final state of an uninterrupted run (``run_trainer.py --ref``), made once."""
    import numpy as np

    ref = ctx.root / "sup-reference.npz"
    if not ref.exists():
        p = subprocess.run([sys.executable, str(TRAINER), "--steps", str(STEPS), "--stats",
                            str(ctx.root / "sup-reference.jsonl"), "--ref", "--out", str(ref)],
                           env=_env(), capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise AssertionError(f"reference run failed: {p.stderr[-1000:]}")
    with np.load(ref) as z:
        return {k: z[k] for k in z.files}


def _bitwise(ctx: Ctx, out: Path) -> bool:
    import numpy as np

    ref = _reference(ctx)
    if not out.exists():
        return False
    with np.load(out) as z:
        got = {k: z[k] for k in z.files}
    return got.keys() == ref.keys() and all(
        got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
        and got[k].tobytes() == ref[k].tobytes() for k in ref)


def _start_run(d: Path, stats: Path, log: Path, *trainer: str,
               run_args: tuple[str, ...] = (), env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
    """``cudasnap run`` in its own session (its own process group, as under a scheduler)."""
    cmd = [sys.executable, "-m", "cudasnap", "run", "--dir", str(d), *run_args, "--",
           sys.executable, str(TRAINER), "--steps", str(STEPS), "--stats", str(stats), *trainer]
    with open(log, "wb") as f:  # (a file: the children hold it)
        return subprocess.Popen(cmd, env=env or _env(), stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)


def _wait_event(stats: Path, pred: Any, proc: subprocess.Popen[bytes],
                timeout: float = 180.0) -> dict[str, Any] | None:
    """The first event of ``stats`` for which ``pred`` holds (polled every 10 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for e in _events(stats):
            if pred(e):
                return e
        if proc.poll() is not None:
            return None
        time.sleep(0.01)
    return None


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group or session is ``pgid``."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and pgid in (int(fields[2]), int(fields[3])):
            out.append(int(p.name))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_gone(pids: Any, timeout: float) -> list[int]:
    """The pids still alive after up to ``timeout`` seconds."""
    end = time.monotonic() + timeout
    left = [p for p in pids if not _gone(p)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [p for p in left if not _gone(p)]
    return left


def _kill_all(pids: Any) -> None:
    for p in pids:
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass


def _newest_complete(ctx: Ctx, d: Path) -> int | None:
    """The step of the newest COMPLETE slot in the directory's arena(s), or None."""
    from cudasnap._native import native
    from cudasnap.format import paths

    job = paths.job_for(d, create=False)
    best = None
    for p in ctx.shm.glob(f"cudasnap-{job}-r*.arena") if job else []:
        a = native().Arena.open(str(p), False)
        try:
            s = a.newest_complete()
            if s >= 0:
                step = a.slot_info(s)["step"]
                best = step if best is None else max(best, step)
        finally:
            del a
    return best


ESCAPE_K = 2  # the first attempt is SIGKILLed at step K; the restart runs K, K+1, K+2, ...


def _escape(ctx: Ctx, case: Case, *, group: bool) -> Case:
    """Item 3. A ``cudasnap run`` (--max-restarts 2: a warm standby beside each attempt)
    whose first attempt is SIGKILLed at step K restarts in the warm standby; after that
    attempt's boundary K+2, ``group``: ``kill -9 -- -PGID`` of the supervisor (a
    scheduler's kill), else ``kill -9`` of the supervisor alone. Then a second ``cudasnap
    run`` on the directory must start and finish bitwise.

    group: nothing of the job survives; the second run starts at the newest COMPLETE
    step in shared memory + 1. Alone: the training process gets SIGTERM
    (PR_SET_PDEATHSIG), flushes and exits; ``latest`` = its last boundary; the second run
    resumes at that step + 1. ``expected``: that step + 1; ``got``: the second run's
    start (None: refused, or something survived)."""
    import signal

    from cudasnap.storage.latest import read_latest


    d, stats = ctx.dir("escape"), ctx.root / f"escape-{case.name}.jsonl"
    log = ctx.root / f"escape-{case.name}.log"
    sup = _start_run(d, stats, log, "--kill-at", str(ESCAPE_K), "--kill-phase", "post_opt",
                     "--sleep-per-step", "0.6", run_args=("--max-restarts", "2"))
    try:
        e = _wait_event(stats, lambda e: e.get("ev") == "boundary" and e["step"] == ESCAPE_K + 2
                        and len(_starts(stats)) >= 2, sup)
        if e is None:
            raise AssertionError(f"the restarted attempt never reached boundary {ESCAPE_K + 2}:"
                                 f" {log.read_text()[-1500:]}")
        s = _starts(stats)
        child = s[-1]["pid"]
        time.sleep(0.2)  # boundary K+2's copy is COMPLETE (the step sleeps 0.6 s after it)
        if group:
            os.killpg(sup.pid, signal.SIGKILL)
        else:
            os.kill(sup.pid, signal.SIGKILL)
        sup.wait(60)
        survivors = _wait_gone([child, *_group(sup.pid)], 60.0 if not group else 10.0)
        if not group and not survivors:
            survivors = _wait_gone(_group(sup.pid), 10.0)
    except BaseException:
        _kill_all(_group(sup.pid))
        raise
    bounds = [x["step"] for x in _events(stats, "boundary") if x["t"] >= s[-1]["t"]]
    warm = (s[-1].get("restore") or {}).get("source")
    latest = read_latest(d)
    latest_step = int(latest.rsplit("-", 1)[-1]) if latest else None
    if group:
        newest = _newest_complete(ctx, d)
        case.expected = None if newest is None else newest + 1
        what = f"newest COMPLETE in shm: {newest}"
    else:
        case.expected = bounds[-1] + 1 if bounds else None
        what = f"latest after the orphan's exit: {latest_step} (its last boundary {bounds[-1:]})"
    if survivors:
        _kill_all(survivors)
        case.got = None
        case.detail = f"SURVIVED the kill: pids {survivors} (training process {child}); {what}"
        _cleanup_arenas(ctx, d)
        return case
    stats2, out = ctx.root / f"escape-{case.name}-2.jsonl", ctx.root / f"escape-{case.name}.npz"
    p = _run(d, stats2, "--out", str(out), run_args=("--max-restarts", "0"))
    _cleanup_arenas(ctx, d)
    s2 = _starts(stats2)
    case.got = s2[0]["start"] if p.returncode == 0 and s2 else None
    if not group and latest_step is not None and case.got is not None:
        case.got = min(case.got, latest_step + 1)  # `latest` must name the last boundary too
    case.torn = case.got is not None and not _bitwise(ctx, out)
    src = (s2[0].get("restore") or {}).get("source") if s2 else None
    case.detail = (f"killed after boundary {e['step']} of attempt {s[-1]['attempt']} (pid {child}, "
                   f"started from {warm}); {what}; no survivor; second run rc {p.returncode}, "
                   f"started at {s2[0]['start'] if s2 else None} from {src}"
                   f"{', final state bitwise' if case.got is not None and not case.torn else ''}")
    if p.returncode != 0:
        case.detail += f"; second run: {p.stderr[-600:]}"
    return case


ESCAPE = (("group kill after a warm restart", True),
          ("supervisor killed alone after a warm restart", False))


def escape_cases(ctx: Ctx, names: tuple[str, ...] | None = None) -> list[Case]:
    out = []
    for name, group in ESCAPE:
        if names is not None and name not in names:
            continue
        case = Case("escape", name, None, need_named=False)
        out.append(guarded(case, lambda c=case, g=group: _escape(ctx, c, group=g)))
    return out


def _config(ctx: Ctx, case: Case) -> Case:
    """Item 6: CUDASNAP_SHM_DIR is a 64 KiB tmpfs that cannot hold the arena of a real
    Snapshotter under ``cudasnap run --max-restarts 3``: one attempt, exit 1, the
    StagingError logged as a configuration error, "not restarting". ``got``: attempts."""
    fs = mount_tmpfs(ctx, "64k")
    if fs is None:
        case.expected, case.detail = None, "skipped: needs root (tmpfs)"
        return case
    try:
        d, stats = ctx.dir("config"), ctx.root / "config.jsonl"
        p = _run(d, stats, "--dim", "256", run_args=("--max-restarts", "3"),
                 env=_env(CUDASNAP_SHM_DIR=str(fs)))
        attempts = len(re.findall(r"training process .* \(attempt \d+\)", p.stderr))
        restarted = "restarting (restart" in p.stderr
        case.got = attempts if p.returncode == 1 and not restarted else None
        case.named = ("configuration error" in p.stderr and "not restarting" in p.stderr
                      and "StagingError" in p.stderr)
        line = next((ln for ln in p.stderr.splitlines() if "configuration error" in ln), "")
        case.detail = f"rc {p.returncode}, {attempts} attempt(s): {line[line.find('the '):][:220]}"
        if "Traceback" in p.stderr and "configuration error" not in p.stderr:
            case.detail += " TRACEBACK"
    finally:
        umount(fs)
        ctx.mounts.remove(fs)
    return case


def config_cases(ctx: Ctx) -> list[Case]:
    case = Case("config", "64 KiB CUDASNAP_SHM_DIR under cudasnap run", 1)
    return [guarded(case, lambda: _config(ctx, case))]


STOP_K = 3


def _stop(ctx: Ctx, case: Case) -> Case:
    """Item 6: ``cudasnap run --watchdog 2``; the first attempt is SIGSTOPped right after
    boundary K (0.5 s a step, so before K+1): the supervisor notices the stop, treats it
    as a hang after 2 s (kills it), restarts; the restart resumes at K+1 and the final
    state is bitwise the uninterrupted run's. ``got``: the restart's start."""
    import signal

    d, stats = ctx.dir("stop"), ctx.root / "stop.jsonl"
    log, out = ctx.root / "stop.log", ctx.root / "stop.npz"
    sup = _start_run(d, stats, log, "--sleep-per-step", "0.5", "--out", str(out),
                     run_args=("--watchdog", "2", "--max-restarts", "1"))
    try:
        e = _wait_event(stats, lambda e: e.get("ev") == "boundary" and e["step"] == STOP_K, sup)
        if e is None:
            raise AssertionError(f"no boundary {STOP_K}: {log.read_text()[-1500:]}")
        pid = _starts(stats)[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.time()
        rc = sup.wait(240)
    except BaseException:
        _kill_all(_group(sup.pid))
        raise
    _cleanup_arenas(ctx, d)
    err = log.read_text()
    s = _starts(stats)
    seen = [x["step"] for x in _events(stats, "boundary") if x["t"] < t_stop and
            (len(s) < 2 or x["t"] < s[1]["t"])]
    if seen and seen[-1] != STOP_K:
        raise AssertionError(f"stopped after boundary {seen[-1]}, not {STOP_K}")
    case.got = s[1]["start"] if rc == 0 and len(s) == 2 else None
    case.named = "stopped by SIGSTOP" in err and "treated as a hang" in err and \
        "restarting (restart 1 of 1)" in err
    case.torn = case.got is not None and not _bitwise(ctx, out)
    hang = _log_time(err, "has been stopped for")
    src = (s[1].get("restore") or {}).get("source") if len(s) == 2 else None
    case.detail = (f"rc {rc}; stop -> killed as a hang {hang - t_stop:.1f} s" if hang else
                   f"rc {rc}; no hang line") + \
        (f"; restarted at step {s[1]['start']} from {src}" if len(s) == 2 else "") + \
        (", final state bitwise" if case.got is not None and not case.torn else "")
    return case


def stop_cases(ctx: Ctx) -> list[Case]:
    case = Case("stop", f"SIGSTOP after boundary {STOP_K}, --watchdog 2", STOP_K + 1)
    return [guarded(case, lambda: _stop(ctx, case))]
