"""Recovery time of a 4-rank DDP job (gloo, CPU) after a SIGKILL of one rank.

torchrun --standalone --nproc-per-node=4 --max-restarts=1 runs
tools/dist/ddp_train.py with the guard on; rank 2 SIGKILLs itself in the
forward of step --kill-step. Phases, from timestamps the ranks write
(OUT/kill.json, CKPT/dist-log.jsonl, OUT/rank-R.json), medians over --repeats:

  detection     kill -> first flush round started on a survivor (gloo error,
                torchrun's SIGTERM or the peer monitor, whichever comes first)
  agreement     -> every survivor knows the agreed step
  flush+commit  -> COMMIT written (all ranks' files, incl. the dead rank's arena
                flushed by rank 0)
  exit+restart  -> first process of the new attempt starts (survivors exit,
                torchrun notices, re-rendezvous, spawn)
  startup       -> last rank ready to restore (python + import torch +
                init_process_group + model + Snapshotter)
  restore       -> every rank restored (agreement on the step + load)

    python bench/distributed.py [--repeats 3] [--state-mb 50] [--no-results]

--fsdp: FSDP2 (``fully_shard``, tools/dist/sharded_train.py) on 4 ranks instead:
the time each step's boundary() blocks the loop against DCP ``async_save`` of the
same sharded state (model + optimizer state_dict, one save in flight) in the same
run, and kill -> every rank resumed (SIGKILL of rank 2, torchrun restart).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import log, machine_line, print_table  # noqa: E402
from tools.dist import launch  # noqa: E402

PHASES = ["detection", "agreement", "flush+commit", "exit+restart", "startup", "restore"]


def one_run(base: Path, width: int, depth: int, steps: int, kill_step: int) -> dict:
    env = {"STEPS": str(steps), "KILL_RANK": "2", "KILL_STEP": str(kill_step),
           "WIDTH": str(width), "DEPTH": str(depth), "CUDASNAP_PEER_TIMEOUT_S": "5"}
    r = launch.run(base, env=env, timeout=600)
    launch.cleanup_arenas(r.job)
    if r.rc != 0 or len(r.ranks) != 4:
        raise SystemExit(f"run failed: rc={r.rc}\n{launch.log_tail(r)}")
    kill = r.kill()["t"]
    ev = [e for e in r.events() if e["epoch"] == 0]
    first = min(e["t"] for e in ev if e["event"] == "flush_start")
    agreed = max(e["t"] for e in ev if e["event"] == "agreed")
    commits = [e for e in ev if e["event"] == "committed"]
    if not commits:
        raise SystemExit(f"no commit:\n{launch.log_tail(r)}")
    commit = commits[0]["t"]
    infos = list(r.ranks.values())
    started = min(i["t_start"] for i in infos)
    ready = max(i["t0"] for i in infos)
    restored = max(i["t_restored"] for i in infos)
    marks = [kill, first, agreed, commit, started, ready, restored]
    out = {p: b - a for p, a, b in zip(PHASES, marks, marks[1:])}
    out["total"] = restored - kill
    out["step"] = commits[0]["step"]
    out["sources"] = sorted({i["restore"]["source"] for i in infos})
    out["replayed"] = kill_step - 1 - min(i["restore"]["step"] for i in infos)
    sizes = [p.stat().st_size for p in (r.ckpt / f"step-{out['step']:08d}").glob("rank-*/data.bin")]
    out["mb_per_rank"] = statistics.median(sizes) / 1e6 if sizes else 0.0
    return out


def fsdp_run(base: Path, width: int, steps: int, kill_step: int) -> dict:
    script = Path(launch.__file__).with_name("sharded_train.py")
    env = {"MODE": "fsdp", "STEPS": str(steps), "WIDTH": str(width)}
    r = launch.run(base / "snap", script=script, timeout=600,
                   env={**env, "KILL_RANK": "2", "KILL_STEP": str(kill_step),
                        "CUDASNAP_PEER_TIMEOUT_S": "5"})
    launch.cleanup_arenas(r.job)
    d = launch.run(base / "dcp", script=script, max_restarts=0, timeout=600,
                   env={**env, "NO_SNAP": "1", "DCP_ASYNC": "1"})
    for x in (r, d):
        if x.rc != 0 or len(x.ranks) != 4:
            raise SystemExit(f"run failed: rc={x.rc}\n{launch.log_tail(x)}")
    snap_ms = statistics.median(i["block_ms"] for i in r.ranks.values())
    dcp_ms = statistics.median(i["block_ms"] for i in d.ranks.values())
    fence_ms = statistics.median(i["fence_ms"] for i in r.ranks.values())
    return {"boundary blocked": snap_ms / 1e3, "fence wait per step": fence_ms / 1e3,
            "async_save blocked": dcp_ms / 1e3,
            "ratio": dcp_ms / snap_ms if snap_ms else float("inf"),
            "kill -> all resumed": max(i["t_restored"] for i in r.ranks.values())
            - r.kill()["t"]}


def fsdp_main(a: argparse.Namespace) -> int:
    width = max(16, int((a.state_mb * 1e6 * 4 / 12) ** 0.5))  # W*W params, 3 copies, 4 ranks
    root = Path(tempfile.mkdtemp(prefix="cudasnap-fsdp-bench-", dir=a.dir or "/var/tmp"))
    runs = []
    try:
        for i in range(a.repeats):
            log(f"run {i + 1}/{a.repeats}: FSDP2, 4 ranks, width {width}")
            runs.append(fsdp_run(root / f"run{i}", width, a.steps, a.kill_step))
            log("  " + ", ".join(f"{k} {v:.4f}" for k, v in runs[-1].items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = list(runs[0])
    rows = [[k, f"{statistics.median(r[k] for r in runs):.4f}" + ("" if k == "ratio" else " s"),
             f"{min(r[k] for r in runs):.4f}", f"{max(r[k] for r in runs):.4f}"] for k in keys]
    note = (f"torchrun 4 ranks, FSDP2 fully_shard on gloo (CPU), about {a.state_mb:.0f} MB of "
            f"model + AdamW state per rank (width {width}); blocked: median per step over the "
            f"ranks (boundary() call; the fence wait of the next optimizer step is its own row, "
            f"a mean); ratio = async_save / boundary; SIGKILL of rank 2 at step {a.kill_step}; "
            f"median of {a.repeats} runs. Machine: {machine_line()}.")
    table = print_table("FSDP2: snapshot vs DCP async_save", ["measure", "median", "min", "max"],
                        rows, note)
    if not a.no_results:
        with open(Path(__file__).with_name("RESULTS.md"), "a") as f:
            f.write("\n## Distributed FSDP2 (4 ranks, CPU)\n\n`python bench/distributed.py "
                    "--fsdp`\n\n" + table)
        log("appended to bench/RESULTS.md")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--state-mb", type=float, default=50.0,
                    help="model + AdamW state per rank (MB); 1024-wide hidden layers")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kill-step", type=int, default=10)
    ap.add_argument("--dir", default=None, help="scratch directory on a real disk (default /var/tmp)")
    ap.add_argument("--no-results", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--fsdp", action="store_true", help="the FSDP2 case (see above)")
    a = ap.parse_args()
    if a.repeats < 2:
        ap.error("--repeats must be >= 2 (medians)")
    if a.fsdp:
        return fsdp_main(a)
    width = 1024
    depth = max(0, round(a.state_mb * 1e6 / 12 / (width * width)))  # param + 2 AdamW moments
    root = Path(tempfile.mkdtemp(prefix="cudasnap-dist-bench-", dir=a.dir or "/var/tmp"))
    runs = []
    try:
        for i in range(a.repeats):
            log(f"run {i + 1}/{a.repeats}: 4 ranks, width {width}, depth {depth}")
            runs.append(one_run(root / f"run{i}", width, depth, a.steps, a.kill_step))
            log("  " + ", ".join(f"{p} {runs[-1][p]:.2f} s" for p in PHASES + ["total"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [[p, f"{statistics.median(r[p] for r in runs):.2f} s",
             f"{min(r[p] for r in runs):.2f} s", f"{max(r[p] for r in runs):.2f} s"]
            for p in PHASES + ["total"]]
    note = (f"torchrun --standalone --nproc-per-node=4 --max-restarts=1, DDP on gloo (CPU), "
            f"{runs[0]['mb_per_rank']:.0f} MB of model + AdamW state per rank; SIGKILL of rank 2 "
            f"in the forward of step {a.kill_step}; median of {a.repeats} runs. Committed step(s): "
            f"{sorted({r['step'] for r in runs})}, replayed steps: "
            f"{sorted({r['replayed'] for r in runs})}, restore sources: "
            f"{sorted({s for r in runs for s in r['sources']})}. Machine: {machine_line()}.")
    table = print_table("Recovery after a SIGKILL of one rank of four", ["phase", "median",
                                                                          "min", "max"], rows, note)
    if not a.no_results:
        section = ("\n## Distributed (4 ranks, CPU)\n\n"
                   "`python bench/distributed.py` (phases: see the script's docstring).\n\n"
                   + table +
                   "\nDetection is immediate on one host: the dead rank's pid is gone (or a "
                   "zombie) and gloo reports the reset connection; across hosts it is the "
                   "heartbeat timeout (`CUDASNAP_PEER_TIMEOUT_S`, default 10 s). "
                   "Exit+restart and startup are torchrun's and Python's (importing torch on "
                   "these cores); a SIGSTOPped (hung) rank adds torchrun's fixed 30 s grace "
                   "before its SIGKILL, which --shutdown-timeout does not change for restarts "
                   "(torch 2.14.1).\n")
        with open(Path(__file__).with_name("RESULTS.md"), "a") as f:
            f.write(section)
        log("appended to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
