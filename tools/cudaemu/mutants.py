"""Held-out mutations of the CUDA path: the emulated lane must fail on each, every time.

Each mutant is one textual change to a source file (an ordering mistake a CUDA
programmer makes). A scratch copy of the working tree is made and built once; each
mutant is applied there, the extension rebuilt (incrementally), the emulated lane's
tests run (per-test timeout), and the change reverted: the mutant is *killed* when the
lane fails. ``--baseline`` first runs
the unmutated copy, which must pass. Exit status 0 only when the baseline (if asked)
passes and every mutant is killed.

    .venv/bin/python tools/cudaemu/mutants.py                 # every mutant, targeted tests
    .venv/bin/python tools/cudaemu/mutants.py --full --baseline   # whole lane, and unmutated
    .venv/bin/python tools/cudaemu/mutants.py --only no-ready-wait --tests tests/cuda_emu/test_ordering.py
    .venv/bin/python tools/cudaemu/mutants.py --list

The last line printed is one JSON object: {"mutants": {name: "killed by <tests>" |
"SURVIVED" | "error: ..."}, "baseline": ..., "seconds": ...}. Killed means a test of the
lane failed on the mutant (a crash or timeout with no failed test is an error).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = "csrc/cuda/copy_engine_cuda.cpp"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    why: str


DONE_AFTER_PHASE_1 = (
    "  issue(plan, 1, data, data_dev, ring, desc_used, staged ? nullptr : &marks, staged);\n"
    "  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][2], copy_stream_));  // the fences' \"done\"\n")

MUTANTS = [
    Mutant("no-ready-wait", ENGINE,
           "  CUDASNAP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, ev_[ring][0], 0));\n", "",
           "the copy stream does not wait for the compute stream's ready event"),
    Mutant("no-step-fence", "cudasnap/core/fences.py",
           "            restored_rng.no_forward()\n        copier.fence(1)\n",
           "            restored_rng.no_forward()\n",
           "the optimizer-step pre-hook no longer fences (Python)"),
    Mutant("done-before-phase-1", ENGINE,
           DONE_AFTER_PHASE_1,
           "  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][2], copy_stream_));\n"
           "  issue(plan, 1, data, data_dev, ring, desc_used, staged ? nullptr : &marks, staged);\n",
           "the done event is recorded before the phase-1 copies (direct or staged) are issued"),
    Mutant("fence-without-wait", ENGINE,
           "  CUDASNAP_CUDA_CHECK(cudaStreamWaitEvent(s, ev, 0));\n  return true;\n",
           "  return true;\n",
           "fence() returns without cudaStreamWaitEvent"),
    Mutant("blocking-copy-stream", ENGINE,
           "cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking)",
           "cudaStreamCreateWithFlags(&copy_stream_, cudaStreamDefault)",
           "the copy stream is a blocking stream (the legacy default stream joins it)"),
    Mutant("done-on-compute-stream", ENGINE,
           "  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][2], copy_stream_));  // the fences'",
           "  CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_[ring][2], compute));  // the fences'",
           "the done event is recorded on the compute stream"),
    Mutant("mark-before-its-batch", ENGINE,
           "  auto mark_at = [&](uint64_t off) {\n    launch_pending();\n"
           "    int k = static_cast<int>(marks->size());\n"
           "    CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_mark_[ring][k], copy_stream_));\n",
           "  auto mark_at = [&](uint64_t off) {\n"
           "    int k = static_cast<int>(marks->size());\n"
           "    CUDASNAP_CUDA_CHECK(cudaEventRecord(ev_mark_[ring][k], copy_stream_));\n"
           "    launch_pending();\n",
           "a progress mark is recorded before the batch of copies it must follow"),
    Mutant("staged-fence-on-drain", ENGINE,
           "    for (int k = 0; k < 3; ++k) job->cuda_events[k] = ev_[ring][k];\n",
           "    for (int k = 0; k < 3; ++k) job->cuda_events[k] = ev_[ring][k == 2 && staged ? 3 : k];\n",
           "with device staging the fences wait for the drain to the host, not the device copy"),
    Mutant("staged-commit-before-drain", ENGINE,
           "    w.segs.push_back(Seg{ev_[ring][3], add_marks(0, d), d, false});\n",
           "    w.segs.push_back(Seg{ev_[ring][2], add_marks(0, d), d, false});\n",
           "with device staging the staged part is checksummed and committed before it drains"),
    Mutant("staged-drain-over-host-ranges", ENGINE,
           "    if (r.host) {\n      barrier = true;\n      continue;\n    }\n",
           "    if (r.host) barrier = true;\n",
           "with device staging the drain copies the buffer over the CPU tensors written at submit"),
    Mutant("restore-no-buffer-wait", "csrc/cuda/device_sink.cpp",
           "  if (l.pending[i]) wait(l, i);  // copies from this buffer's last unit must have read it\n",
           "  l.pending[i] = false;\n",
           "a restore reads the next unit into a buffer whose copies to the device are queued"),
    Mutant("restore-not-after-queued-work", "cudasnap/core/device_restore.py",
           "    torch.cuda.synchronize(device)\n", "",
           "a restore to the device does not wait for work still queued for the tensors"),
    Mutant("no-writer-join", "cudasnap/core/copier.py",
           "            why = be.cuda.follow(self._writers)", "            why = None",
           "the copy does not wait for the registered writer streams (Python)"),
    Mutant("no-writer-fence", "cudasnap/core/copier.py",
           "        for s in self._writers if cuda is not None else ():",
           "        for s in ():",
           "fences do not hold the registered writer streams (Python)"),
]


# Where the orderings are tested: a mutant these kill also fails the whole lane
# (`make test-emulated` runs them), in a fraction of its time.
TARGETED = ["tests/cuda_emu/test_ordering.py", "tests/cuda_emu/test_staging_order.py",
            "tests/cuda_emu/test_device_restore.py", "tests/cuda_emu/test_native_cuda.py",
            "tests/cuda_emu/test_cuda_lane.py"]


def tree_files(root: Path) -> list[str]:
    """The working tree as git sees it: tracked and untracked, not ignored."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                         check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def scratch_copy(dest: Path) -> None:
    for f in tree_files(REPO):
        d = dest / f
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, d)
    (dest / ".venv").symlink_to(REPO / ".venv")  # the same interpreter and packages


def mutate(dest: Path, m: Mutant) -> None:
    p = dest / m.path
    text = p.read_text()
    n = text.count(m.old)
    if n != 1:
        raise RuntimeError(f"mutant {m.name}: its text occurs {n} times in {m.path} "
                           "(the source changed: update tools/cudaemu/mutants.py)")
    p.write_text(text.replace(m.old, m.new))


def run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float) -> tuple[int, str]:
    """Runs ``cmd``, appending its output to ``log``; returns (exit status, output)."""
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout)
        rc, out = p.returncode, p.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") + "\n(timed out)\n"
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n{out}")
    return rc, out


def failed_tests(out: str) -> list[str]:
    """The tests pytest's summary names as failed (assertion or error in a test)."""
    return [ln.split()[1] for ln in out.splitlines()
            if ln.startswith(("FAILED tests/", "ERROR tests/"))]


class Scratch:
    """One scratch copy of the working tree, built once; each mutant is applied in place,
    rebuilt incrementally (the same path keeps CMake's cache valid: only the mutated
    file recompiles) and reverted after its run."""

    def __init__(self, work: Path, test_timeout: int) -> None:
        self.dest = work / "tree"
        self.log = work / "mutants.log"
        self.test_timeout = test_timeout
        scratch_copy(self.dest)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("CUDASNAP_", "CUDAEMU_"))}
        self.env["PYTHONPATH"] = str(self.dest)  # the scratch copy's cudasnap, not the editable one
        self.env["CUDASNAP_BUILD_DIR"] = str(self.dest / "build" / "cmake")
        self.py = str(self.dest / ".venv" / "bin" / "python")

    def build(self) -> bool:
        return run([self.py, "setup.py", "-q", "build_ext", "--inplace"], self.dest, self.env,
                   self.log, 1800)[0] == 0

    def lane(self, tests: list[str]) -> tuple[int, str]:
        return run([str(self.dest / "tools/cudaemu/run.sh"), self.py, "-m", "pytest", "-q", "-x",
                    "-p", "no:cacheprovider", "-o", f"timeout={self.test_timeout}", *tests],
                   self.dest, self.env, self.log, 3600)

    def trial(self, m: Mutant | None, tests: list[str]) -> tuple[str, float]:
        """The lane's verdict on the tree mutated by ``m`` (None: as it is)."""
        t0 = time.monotonic()
        path = self.dest / m.path if m else None
        original = path.read_text() if path else ""
        with self.log.open("a") as f:
            f.write(f"\n===== {m.name if m else 'baseline'}\n")
        try:
            if m:
                mutate(self.dest, m)
            if not self.build():
                return f"error: build failed (see {self.log})", time.monotonic() - t0
            rc, out = self.lane(tests)
        finally:
            if path:
                path.write_text(original)
        failed = failed_tests(out)
        if m is None:
            verdict = "passed" if rc == 0 else f"FAILED (rc {rc}, see {self.log})"
        elif rc == 0:
            verdict = "SURVIVED"
        elif failed:  # a test failed on it: killed (by which test, for the record)
            verdict = "killed by " + ", ".join(f.rsplit("::", 1)[-1] for f in failed)
        else:  # a crash, a timeout or a collection error is not a test catching it
            verdict = f"error: the lane ended with rc {rc} and no failed test (see {self.log})"
        return verdict, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run this mutant (repeatable)")
    ap.add_argument("--tests", nargs="*", default=TARGETED,
                    help="test paths of the lane (default: the ordering tests and the lane's "
                         "end-to-end file; --full: all of tests/cuda_emu)")
    ap.add_argument("--full", action="store_true", help="run the whole emulated lane")
    ap.add_argument("--baseline", action="store_true", help="also run the unmutated copy")
    ap.add_argument("--test-timeout", type=int, default=120, help="per-test timeout (s)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    a = ap.parse_args(argv)
    if a.full:
        a.tests = ["tests/cuda_emu"]
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:24s} {m.path}: {m.why}")
        return 0
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only]
    unknown = set(a.only) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutant(s): {sorted(unknown)}")
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="cudasnap-mutants-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result: dict[str, object] = {"work": str(work)}
    ok = True
    scratch = Scratch(work, a.test_timeout)
    if a.baseline:
        verdict, secs = scratch.trial(None, a.tests)
        print(f"baseline: {verdict} ({secs:.0f} s)", flush=True)
        result["baseline"] = verdict
        ok = verdict == "passed"
    verdicts = {}
    for m in chosen:
        verdict, secs = scratch.trial(m, a.tests)
        print(f"{m.name}: {verdict} ({secs:.0f} s) - {m.why}", flush=True)
        verdicts[m.name] = verdict
        ok = ok and verdict.startswith("killed")
    result["mutants"] = verdicts
    result["seconds"] = round(time.monotonic() - t0, 1)
    if not a.keep:
        shutil.rmtree(scratch.dest, ignore_errors=True)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
