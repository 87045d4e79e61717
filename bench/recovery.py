"""Recovery time (issue 46): a rank SIGKILLed at a random moment of a random step, the in-process
restart (cudasnap.distributed.inprocess: survivors keep their process, a warm spare takes the
lost rank, every rank restores from shared memory) against today's full restart (``cudasnap run
-- torchrun --max-restarts=0``: every process starts again), measured side by side in one run.

    python bench/recovery.py --quick            # 2 and 4 ranks, 5 trials per mode and size,
                                                # and 5 node losses (2 nodes x 2 ranks)
    python bench/recovery.py --worlds 2 --trials 3

The job: tools/stacks/inprocess_train.py (a data-parallel MLP on gloo, CPU) through
tools/stacks/inprocess_harness.py. Each trial: kill -> every rank of the job after it executed
its first step (``kill_to_all_stepping_s``), the survivors' pids kept (in-process), the steps
replayed, and the final state of every rank against an uninterrupted run (bitwise). Prints one
JSON line: per world size and mode the median seconds and the in-process / full-restart ratio.

Node loss (``node_loss``): 2 "nodes" of 2 ranks, each its own shared memory and node id
(CUDASNAP_NODE_REPLICA=1), and 2 spares on a third; both processes of one node SIGKILLed at once
and its memory removed. Nothing on the other node sees their pids: the loss is seen when their
heartbeats go stale (``stale_s``, 1.5 s), as a node that lost power. The spares restore from the
copies the surviving node holds. Its full-restart counterpart is bench/node_loss.py
(``recovery_s_peer``: every process of both nodes started again), not run here.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.stacks import inprocess_harness as harness  # noqa: E402

STEPS = 30


def _bitwise(ref: harness.Trial, t: harness.Trial, world: int) -> bool:
    import torch

    try:
        a, b = ref.dumps(world), t.dumps(world)
    except FileNotFoundError:
        return False
    return all(a[r]["tensors"].keys() == b[r]["tensors"].keys() and all(
        torch.equal(a[r]["tensors"][k], b[r]["tensors"][k]) for k in a[r]["tensors"])
        for r in range(world))


def _trial(mode: str, world: int, work: Path, ref: harness.Trial,
           rng: random.Random) -> dict[str, Any]:
    victim = rng.randrange(world)
    kill_after = rng.randrange(3, STEPS - 8)
    if mode in ("inprocess", "node_loss"):
        nodes = 2 if mode == "node_loss" else 1
        victim = victim - victim % 2 if nodes == 2 else victim  # the lost node's first rank
        t = harness.run(work, world, nodes, STEPS, victim=victim, kill_after=kill_after,  # a spare per lost rank
                        rng=rng, nodes=nodes)
        before = {s["uid"]: s["pid"] for s in t.starts if s["gen"] == 0}
        kept = all(s["pid"] == before.get(s["uid"]) for s in t.starts
                   if s["gen"] > 0 and s["uid"] in before)
    else:
        t = harness.classic(work, world, STEPS, victim=victim, kill_after=kill_after, rng=rng)
        kept = False
    sources = sorted({s["src"] for s in t.starts if t.killed_at and s["t"] > t.killed_at})
    return {"mode": mode, "world": world, "victim": victim, "kill_after": kill_after,
            "kill_to_all_stepping_s": t.recovered_s(world), "survivor_pids_kept": kept,
            "replayed_steps": t.replayed(), "bitwise": _bitwise(ref, t, world),
            "restore_source": sources, "rc": t.rc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 and 4 ranks, 5 trials each")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--node-loss-trials", type=int, default=None,
                    help="node losses on 2 nodes x 2 ranks (default: --trials; 0: none)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-") as tmp:
        for world in [int(w) for w in a.worlds.split(",")]:
            ref = harness.reference(Path(tmp) / f"ref{world}", world, STEPS)
            for i in range(a.trials):
                for mode in ("inprocess", "full_restart"):
                    r = _trial(mode, world, Path(tmp) / f"{mode}{world}-{i}", ref, rng)
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
            med = {}
            for mode in ("inprocess", "full_restart"):
                secs = [r["kill_to_all_stepping_s"] for r in rows if r["world"] == world
                        and r["mode"] == mode and r["kill_to_all_stepping_s"] is not None]
                med[mode] = statistics.median(secs) if secs else None
            ok = [r for r in rows if r["world"] == world]
            summary[f"world{world}"] = {
                "kill_to_all_stepping_s_median": med,
                "ratio_full_over_inprocess": (med["full_restart"] / med["inprocess"]
                                              if med["inprocess"] and med["full_restart"]
                                              else None),
                "bitwise": sum(r["bitwise"] for r in ok), "trials": len(ok),
                "max_replayed": max((r["replayed_steps"] or 0) for r in ok),
                "survivor_pids_kept": all(r["survivor_pids_kept"] for r in ok
                                          if r["mode"] == "inprocess")}
        n_node = a.trials if a.node_loss_trials is None else a.node_loss_trials
        if n_node:
            ref = harness.reference(Path(tmp) / "ref-node", 4, STEPS)
            for i in range(n_node):
                r = _trial("node_loss", 4, Path(tmp) / f"node{i}", ref, rng)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
            nl = [r for r in rows if r["mode"] == "node_loss"]
            secs = [r["kill_to_all_stepping_s"] for r in nl if r["kill_to_all_stepping_s"]]
            summary["node_loss"] = {
                "nodes": 2, "ranks_per_node": 2,
                "kill_to_all_stepping_s_median": statistics.median(secs) if secs else None,
                "bitwise": sum(r["bitwise"] for r in nl), "trials": len(nl),
                "max_replayed": max((r["replayed_steps"] or 0) for r in nl),
                "survivor_pids_kept": all(r["survivor_pids_kept"] for r in nl),
                "restore_source": sorted({s for r in nl for s in r["restore_source"]})}
    out = {"bench": "recovery", "seed": seed, "steps": STEPS, "summary": summary,
           "trials": rows}
    line = json.dumps(out)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    bad = [r for r in rows if not r["bitwise"] or (r["replayed_steps"] or 0) > 1]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
