"""Kill matrix (issue 44): real stacks SIGKILLed from outside at random moments, each trial
checked bitwise against an uninterrupted run of the same stack (tools/stacks/killer.py).

    python bench/kill_matrix.py --quick            # 20 trials: 4 per stack
    python bench/kill_matrix.py --trials 10        # 10 per stack
    python bench/kill_matrix.py --stacks titan-pp,hf-ddp --seed 7

Stacks: torchtitan's llama3 debug model on 2 CPU ranks (FSDP2, tensor parallel, pipeline
parallel; attention dropout on; a committed interval flush every 2 steps) and a Hugging Face
Trainer (single process, DDP on 2 ranks). Each trial draws the step, the moment in it (a
share of a step's time) and the victim (one rank or every rank), kills, lets ``cudasnap run``
restart the job to its end and compares parameters, optimizer state, LR schedulers,
counters, RNG and the data position with the reference.

Prints a markdown table and, last, one JSON object: every trial, and per stack the trials,
bitwise count, replayed steps (max) and the median seconds from the kill to the first
resumed step (``--out FILE`` writes the JSON there too). Exits 1 when any trial is not
bitwise, replayed more than one step, or did not finish.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.stacks import killer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 trials per stack (20 in all)")
    ap.add_argument("--trials", type=int, default=None, help="trials per stack")
    ap.add_argument("--stacks", default=",".join(killer.STACKS),
                    help=f"comma-separated, of {', '.join(killer.STACKS)}")
    ap.add_argument("--seed", type=int, default=None, help="replays a matrix")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    per = a.trials or (4 if a.quick else 10)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    work = a.work or Path(tempfile.mkdtemp(prefix="kill-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    killer.setup(work)
    results: list[killer.Result] = []
    skipped: dict[str, str] = {}
    t0 = time.monotonic()
    for name in [s for s in a.stacks.split(",") if s]:
        stack = killer.STACKS[name]()
        why = stack.available()
        if why:
            skipped[name] = why
            continue
        ref, _ = killer.run_reference(stack, work)
        for _ in range(per):
            r = killer.random_trial(stack, ref, work, rng)
            results.append(r)
            print(killer.table([r]).splitlines()[-1], flush=True)
    print(f"\nseed {seed}; {len(results)} trials in {time.monotonic() - t0:.0f} s\n")
    print(killer.table(results))
    summary = {}
    for name in dict.fromkeys(r.stack for r in results):
        rs = [r for r in results if r.stack == name]
        times = [r.kill_to_resumed_s for r in rs if r.kill_to_resumed_s is not None]
        summary[name] = {"trials": len(rs), "bitwise": sum(r.bitwise for r in rs),
                         "ok": sum(r.ok for r in rs),
                         "replayed_max": max((r.replayed or 0 for r in rs), default=None),
                         "kill_to_resumed_s_median": statistics.median(times) if times
                         else None}
    out = {"bench": "kill_matrix", "seed": seed, "trials": len(results),
           "ok": sum(r.ok for r in results), "per_stack": summary, "skipped": skipped,
           "results": killer.as_json(results)}
    text = json.dumps(out)
    print(text)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
