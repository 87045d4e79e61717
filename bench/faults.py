"""The whole fault matrix: inject every fault of tools/faults/matrix.py and print a table.

    .venv/bin/python bench/faults.py [--seed S] [--trunc N] [--flip N] [--shm N]
                                     [--families disk,shm,kill,...] [--json out.json]
    .venv/bin/python bench/faults.py --negative

Columns: faults tried, recovered (the expected step restored bitwise, with a
message naming the damaged file where one is due), lost snapshots (an
undamaged snapshot that did not load: must be 0), torn loads (a restored state
that is not bitwise one step's: must be 0), named (messages that name the
file/arena, of those required), errors (a case that crashed). The supervisor family
(`cudasnap run`: kill + restart, disk full in the orphan flush, two runs on one
directory, a deleted directory, a clean exit, a kill during / right after a long
flush, a kill right after close(), a slow orphan flush beside the restart) counts
steps resumed or, where a case says so, attempts or conditions met. Exit status 1
when anything was lost, torn or crashed. Needs root for the tmpfs families
(disk full falls back to RLIMIT_FSIZE without it; config is skipped).

Issue 23's families (each case a few real processes; minutes on 2 cores):
  endjob       2 gloo ranks under torchrun (and once under `cudasnap run`) end the job
               with flush() + close() while one rank is late (gated on the store, or an
               ungated sleep drawn by --seed), stuck before or dead at its last
               boundary: `latest` = the last step (the one before for stuck/dead), no
               restart, no peer-failure line, every flush() quick.
  escape       `cudasnap run` restarted once (warm standby), then its process group
               SIGKILLed (nothing survives; the next run starts at the newest COMPLETE
               step + 1) or the supervisor alone (its child flushes and exits; `latest` =
               its last boundary); the next run finishes bitwise.
  config       CUDASNAP_SHM_DIR a 64 KiB tmpfs: one attempt, exit 1, "configuration
               error ... not restarting".
  stop         the attempt SIGSTOPped under --watchdog 2: treated as a hang, restarted
               at the step after its last boundary, final state bitwise.
  jobmismatch  2 gloo ranks restoring with different CUDASNAP_JOB: both fail at once
               with a ConfigError naming both jobs.

--negative runs only the supervisor cases of issue 14 items 1, 2 and 7 set back to
the behaviour before the fix (the trainer's Snapshotter without the spare slot or the
flush on close; a supervisor that flushes before it restarts): every one of them
must be LOST there (exit status 1 otherwise), which shows that those cases can fail.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.faults import matrix as F  # noqa: E402
from tools.faults.endjob import endjob_cases, jobmismatch_cases  # noqa: E402
from tools.faults.supervisor import (  # noqa: E402
    config_cases,
    escape_cases,
    stop_cases,
    supervisor_cases,
)

FAMILIES = ("disk", "shm", "kill", "diskfull", "shmfull", "lock", "dist", "export",
            "supervisor", "endjob", "escape", "config", "stop", "jobmismatch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--trunc", type=int, default=200, help="truncation cases (disk)")
    ap.add_argument("--flip", type=int, default=200, help="byte-flip cases (disk)")
    ap.add_argument("--shm", type=int, default=60, help="shared-memory flip cases")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--json", help="write every case here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failed case")
    ap.add_argument("--negative", action="store_true",
                    help="only the negative controls of the supervisor cases (must be LOST)")
    a = ap.parse_args()
    if a.negative:
        return negative_controls()
    fams = tuple(f for f in a.families.split(",") if f)
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        ap.error(f"unknown families {bad}; choose from {FAMILIES}")
    with tempfile.TemporaryDirectory(prefix="cudasnap-faults-") as tmp:
        ctx = F.Ctx(root=Path(tmp), prefix=f"bflt{uuid.uuid4().hex[:8]}")
        t0 = time.perf_counter()
        try:
            cases = F.run_matrix(ctx, seed=a.seed, n_trunc=a.trunc, n_flip=a.flip, n_shm=a.shm,
                                 families=fams, progress=lambda s: print(f"  {s}", flush=True))
            if "supervisor" in fams:  # `cudasnap run` itself: kills, full disk, shared dirs
                cases += supervisor_cases(ctx)
                print("  supervisor done", flush=True)
            # issue 23: the end of a multi-rank job, an escaped child, a configuration
            # error, a SIGSTOPped child, ranks of different jobs
            for fam, fn in (("endjob", lambda: endjob_cases(ctx, seed=a.seed)),
                            ("escape", lambda: escape_cases(ctx)),
                            ("config", lambda: config_cases(ctx)),
                            ("stop", lambda: stop_cases(ctx)),
                            ("jobmismatch", lambda: jobmismatch_cases(ctx))):
                if fam in fams:
                    t1 = time.perf_counter()
                    cases += fn()
                    print(f"  {fam} done ({time.perf_counter() - t1:.0f} s)", flush=True)
        finally:
            ctx.cleanup()
        secs = time.perf_counter() - t0
    print(f"\nfault matrix, seed {a.seed}, {secs:.0f} s (uid {os.geteuid()}):\n")
    print(F.table(cases))
    for fam in ("supervisor", "endjob", "escape", "config", "stop", "jobmismatch"):
        few = [c for c in cases if c.family == fam]
        if few:  # few, and their details carry the figures (steps resumed, latencies)
            print(f"\n{fam} cases:")
            for c in few:
                print("  " + c.line())
    failed = [c for c in cases if not c.recovered]
    if failed:
        print(f"\n{len(failed)} case(s) not fully recovered:")
        for c in failed if a.verbose else failed[:20]:
            print("  " + c.line())
    if a.json:
        Path(a.json).write_text(json.dumps([{**c.__dict__, "lost": c.lost,
                                             "recovered": c.recovered} for c in cases], indent=1))
    return 1 if any(c.lost or c.torn or c.error for c in cases) else 0


def negative_controls() -> int:
    with tempfile.TemporaryDirectory(prefix="cudasnap-faults-") as tmp:
        ctx = F.Ctx(root=Path(tmp), prefix=f"bflt{uuid.uuid4().hex[:8]}")
        t0 = time.perf_counter()
        try:
            cases = supervisor_cases(ctx, negative=True)
        finally:
            ctx.cleanup()
    print(f"negative controls (the behaviour before the fixes), {time.perf_counter() - t0:.0f} s:\n")
    print(F.table(cases))
    for c in cases:
        print("  " + c.line())
    return 0 if all(c.lost and not c.error for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
