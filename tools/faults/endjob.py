"""Multi-rank fault families of issue 23 for bench/faults.py: ``endjob`` and ``jobmismatch``.

endjob (item 1, the end of a multi-rank job): each case runs
tools/dist/end_of_job_worker.py with 2 ranks on gloo under torchrun (--max-restarts=1;
0 for ``stuck``/``dead``, whose failure is the fault), a fresh directory and job,
CUDASNAP_PEER_TIMEOUT_S=10, STEPS=6 (last step 5): ``flush()`` on every rank, then
``close()``, with one rank late to its last boundary. ``expected`` = 5 (4 when a rank is
stuck or dead), ``got`` = the step ``latest`` names. An error: any restart (attempt or
restart != 0 in a rank's result, "restarting" in the output), a non-zero exit (a zero
one for ``dead``), a "silent"/"is gone"/"peer failure" log line. Not recovered (``ok``
False) when a rank's ``flush()`` took 4 s or more (LATE_S + 4 s when the lateness is an
ungated sleep; the agreement bound + 4 s for ``stuck``; for ``dead``: rank 0's
flush_start -> agreed).

jobmismatch (item 6): 2 gloo ranks restore with a different CUDASNAP_JOB each (a
fresh directory; a committed 2-rank layout): both must exit non-zero well within the
peer timeout with a ConfigError naming both jobs. ``expected`` = 2, ``got`` = the ranks
that did.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:  # run as a script (the jm-rank processes)
    sys.path.insert(0, str(REPO))

STEPS = 6
WORLD = 2
PEER_TIMEOUT_S = 10.0
HEARTBEAT_S = 0.5  # the coordinator's default
QUICK_S = 4.0


def _latest(ckpt: Path) -> int | None:
    from cudasnap.format import paths

    p = ckpt / paths.LATEST
    if not p.exists():
        return None
    return int(p.read_text().strip().rsplit("-", 1)[-1])


def _ranks(out: Path) -> dict[int, dict[str, Any]]:
    res = {}
    for r in range(WORLD):
        f = out / f"rank-{r}.json"
        if f.exists():
            res[r] = json.loads(f.read_text())
    return res


_BAD_LINES = ("is silent", "is gone", "peer failure")


def _judge(case: Any, *, rc: int, log: str, ckpt: Path, out: Path, late_rank: int,
           scenario: str, gated: bool, bound_s: float, seconds: float) -> Any:
    case.got = _latest(ckpt)
    ranks = _ranks(out)
    errs = []
    if scenario == "dead":
        if rc == 0:
            errs.append("exit 0 although a rank was SIGKILLed")
    elif rc != 0:
        errs.append(f"exit {rc}")
    restarted = [r for r, i in ranks.items() if i.get("attempt") or i.get("restart")]
    if restarted or "restarting" in log.lower():
        errs.append(f"restarted (ranks {restarted})")
    if scenario != "dead":
        bad = sorted({b for b in _BAD_LINES if b in log})
        if bad:
            errs.append(f"log says {bad}")
        missing = [r for r in range(WORLD) if r not in ranks]
        if missing:
            errs.append(f"no result from rank(s) {missing}")
    if scenario == "late" and gated and late_rank in ranks:
        have = (ranks[late_rank].get("gate") or {}).get("have")
        if have is None or str(STEPS - 1) in have.split(","):
            errs.append(f"the late rank was not gated on the round: {ranks[late_rank].get('gate')}")
    flush = {r: round(i["flush_s"], 2) for r, i in ranks.items() if "flush_s" in i}
    if scenario == "dead":
        from cudasnap.distributed.events import read_events

        ev = [e for e in read_events(ckpt) if e.get("rank") == 0]
        start = next((e for e in ev if e["event"] == "flush_start"
                      and e.get("target") == STEPS - 1), None)
        agreed = next((e for e in ev if start is not None and e["event"] == "agreed"
                       and e["gen"] == start["gen"]), None)
        took = agreed["t"] - start["t"] if agreed is not None else None
        case.ok = took is not None and took < bound_s
        case.detail = (f"rank 0's explicit flush agreed {took:.2f} s after it began"
                       if took is not None else "rank 0's explicit flush never agreed") + \
            f" (bound {bound_s:.0f} s); rc {rc}"
    else:
        slow = {r: s for r, s in flush.items() if s >= bound_s}
        case.ok = not slow and bool(flush)
        case.detail = f"flush_s {flush} (bound {bound_s:.1f} s)"
    case.detail += f"; {seconds:.0f} s"
    if errs:
        tail = "\n".join(ln for ln in log.splitlines()[-15:])
        case.error = "; ".join(errs) + f" | log tail: {tail[-1200:]}"
    return case


def endjob_torchrun(ctx: Any, case: Any, *, env: dict[str, str], late_rank: int,
                     scenario: str, gated: bool, bound_s: float) -> Any:
    from tools.dist import launch

    base = ctx.dir("endjob")
    mr = 0 if scenario in ("stuck", "dead") else 1
    full = {"STEPS": str(STEPS), "CUDASNAP_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
            "LATE_RANK": str(late_rank), "SCENARIO": scenario, "GATE": "1" if gated else "0",
            **env}
    r = launch.run(base, nproc=WORLD, max_restarts=mr,
                   script=REPO / "tools" / "dist" / "end_of_job_worker.py", timeout=240,
                   env=full)
    launch.cleanup_arenas(r.job)
    return _judge(case, rc=r.rc, log=r.log, ckpt=r.ckpt, out=r.out, late_rank=late_rank,
                  scenario=scenario, gated=gated, bound_s=bound_s, seconds=r.seconds)


def _endjob_cudasnap_run(ctx: Any, case: Any) -> Any:
    """``cudasnap run --max-restarts 1 -- torchrun --max-restarts=0 ...``, FSDP2, gated."""
    from tools.dist import launch

    base = ctx.dir("endjob-run")
    ckpt, out, store = base / "ckpt", base / "out", base / "store"
    store.mkdir(parents=True)
    job = launch.new_job()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env.update({"OUT": str(out), "STORE_DIR": str(store), "MODE": "fsdp", "STEPS": str(STEPS),
                "CUDASNAP_JOB": job, "CUDASNAP_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
                "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "LATE_RANK": "1", "LATE_S": "0.5"})
    cmd = [sys.executable, "-m", "cudasnap", "run", "--dir", str(ckpt), "--max-restarts", "1",
           "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={WORLD}", "--max-restarts=0", "--monitor-interval=0.1",
           f"--rdzv-id={uuid.uuid4().hex[:8]}", str(REPO / "tools" / "dist" /
                                                    "end_of_job_worker.py")]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=300)
        rc, log = p.returncode, p.stdout
    finally:
        launch.cleanup_arenas(job)
    return _judge(case, rc=rc, log=log, ckpt=ckpt, out=out, late_rank=1, scenario="late",
                  gated=True, bound_s=QUICK_S, seconds=time.monotonic() - t0)


def endjob_cases(ctx: Any, seed: int = 23, n_ungated: int = 4) -> list[Any]:
    from tools.faults.matrix import Case, guarded

    rng = random.Random(seed)
    specs: list[tuple[str, int, Any]] = []

    def add(name: str, expected: int, **kw: Any) -> None:
        specs.append((name, expected, lambda c, kw=kw: endjob_torchrun(ctx, c, **kw)))

    for mode in ("plain", "fsdp"):
        for late in (1, 0):
            add(f"gated late rank {late}, {mode}", STEPS - 1,
                env={"MODE": mode, "LATE_S": "0.5"}, late_rank=late, scenario="late",
                gated=True, bound_s=QUICK_S)
    for i in range(n_ungated):
        late_s, late, mode = rng.uniform(0.0, 3.0), rng.choice((0, 1)), ("plain", "fsdp")[i % 2]
        add(f"ungated late rank {late} by {late_s:.2f} s, {mode}", STEPS - 1,
            env={"MODE": mode, "LATE_S": f"{late_s:.3f}"}, late_rank=late, scenario="late",
            gated=False, bound_s=late_s + QUICK_S)
    add("gated late rank 1, plain, snapshot_every=4", STEPS - 1,
        env={"MODE": "plain", "LATE_S": "0.5", "SNAPSHOT_EVERY": "4"}, late_rank=1,
        scenario="late", gated=True, bound_s=QUICK_S)
    specs.append(("gated late rank 1, fsdp, under cudasnap run", STEPS - 1,
                  lambda c: _endjob_cudasnap_run(ctx, c)))
    add("stuck rank 1 (skips its last boundary)", STEPS - 2, env={"MODE": "plain"},
        late_rank=1, scenario="stuck", gated=True,
        bound_s=PEER_TIMEOUT_S + 4 * HEARTBEAT_S + QUICK_S)
    add("dead rank 1 (SIGKILL before its last boundary)", STEPS - 2, env={"MODE": "plain"},
        late_rank=1, scenario="dead", gated=True, bound_s=QUICK_S)
    out = []
    for name, expected, fn in specs:
        case = Case("endjob", name, expected, need_named=False)
        out.append(guarded(case, lambda c=case, f=fn: f(c)))
    return out


# ------------------------------------------------------------- jobmismatch

JOBMISMATCH = ("fresh directory", "committed 2-rank layout")


def jobmismatch_cases(ctx: Any, timeout: float = 150.0, bound_s: float = PEER_TIMEOUT_S,
                      names: tuple[str, ...] = JOBMISMATCH) -> list[Any]:
    """``bound_s``: a rank counts when its restore failed within this (default: the peer
    timeout; tests pass a failure guard instead of a wall-time bound)."""
    from tools.faults.matrix import Case, build_dist_layout, guarded

    out = []
    for name in names:
        case = Case("jobmismatch", name, WORLD)

        def one(case: Any = case, name: str = name) -> Any:
            if name == "fresh directory":
                d = ctx.dir("jm")
                d.mkdir(parents=True)
            else:
                d = build_dist_layout(ctx)
            jobs = [ctx.job("jma"), ctx.job("jmb")]
            init = ctx.root / f"jm-init-{uuid.uuid4().hex[:6]}"
            base = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
            base.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                         "CUDASNAP_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
                         "CUDASNAP_HEALTH": "0"})
            procs = [subprocess.Popen([sys.executable, __file__, "jm-rank", str(r), str(init),
                                       str(d), str(ctx.shm)],
                                      env={**base, "CUDASNAP_JOB": jobs[r]},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r in range(WORLD)]
            got, named, det = 0, True, []
            for r, p in enumerate(procs):
                try:
                    so, se = p.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    so, se = p.communicate()
                    det.append(f"rank {r} still waiting after {timeout:.0f} s")
                    named = False
                    continue
                recs = [json.loads(x) for x in so.splitlines() if x.startswith("{")]
                rec = recs[-1] if recs else {}
                err, took = rec.get("error", ""), rec.get("restore_s")
                fast = took is not None and took < bound_s
                both = all(repr(j) in err or j in err for j in jobs)
                if p.returncode != 0 and err.startswith("ConfigError") and fast:
                    got += 1
                named = named and both
                when = f"{took:.2f} s" if took is not None else "no result"
                det.append(f"rank {r}: rc {p.returncode}, {when}, "
                           f"{err[:160] or se[-300:]!r}")
            case.got = got
            case.named = named
            case.detail = "; ".join(det)
            for p in ctx.shm.glob("cudasnap-" + ctx.prefix + "-jm*"):
                p.unlink(missing_ok=True)
            return case
        out.append(guarded(case, one))
    return out


def _jm_rank_main(rank: int, init: str, d: str, shm: str) -> int:
    """One rank of a jobmismatch case: restore with this process's CUDASNAP_JOB."""
    import logging

    import torch
    import torch.distributed as dist

    from cudasnap.snapshotter import Snapshotter

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    m = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    rec: dict[str, Any] = {"rank": rank, "job": os.environ.get("CUDASNAP_JOB")}
    t0 = time.monotonic()
    rc = 0
    try:
        snap = Snapshotter(m, opt, directory=d, rank=rank, world_size=WORLD, distributed=True,
                           copy_threads=1, shm_dir=shm)
        try:
            rec["start"] = snap.restore_latest()
        finally:
            snap.close()
    except Exception as e:  # noqa: BLE001 - the outcome under test
        rec["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    rec["restore_s"] = time.monotonic() - t0
    print(json.dumps(rec), flush=True)
    os._exit(rc)  # (no destroy_process_group: the peer may be gone)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "jm-rank":
    sys.exit(_jm_rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]))
