"""bench/gpu_check.sh and bench/gpu_bench.py without a GPU: syntax, help, the skip path,
the watchdog, the phase budgets (the functions, sourced), the last line
("gpu_check: PASS/FAIL ...") on every path, --emulated's wiring and a PARTIAL bench as a
warning (with a stand-in interpreter: seconds, no torch), and (slow) every phase of the
script with the GPU detection faked.

The device run is unattended and one-shot, so what can break before it reaches the GPU
is checked here. CUDA_VISIBLE_DEVICES="" makes torch see no device even on a GPU
machine, so these tests mean the same everywhere.
"""
from __future__ import annotations

import json
import os
import py_compile
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
BENCH = REPO / "bench" / "gpu_bench.py"
SKIP = "skipped: no CUDA device"
LIMIT_S = 600  # what one command may run on a lent GPU machine


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("OUT", "CUDASNAP_GPU_CHECK_FAKE", "CUDASNAP_HEALTH")}
    e.update(CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    e.update(extra)
    return e


def run(cmd: list[str], timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(**extra), capture_output=True, text=True,
                          timeout=timeout)


def test_script_syntax():
    p = run(["bash", "-n", str(SCRIPT)])
    assert p.returncode == 0, p.stderr


def last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1] if text.strip() else ""


def test_script_without_gpu_skips_fast_with_a_clear_message(tmp_path):
    p = run(["bash", str(SCRIPT)], timeout=60)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert SKIP in p.stdout, p.stdout
    assert last_line(p.stdout).startswith("gpu_check: PASS (skipped: no CUDA device, nothing "
                                          "was checked"), p.stdout
    assert "phase build" not in p.stdout  # detected before anything expensive
    # with $OUT the same, teed into $OUT/gpu_check.log
    p = run(["bash", str(SCRIPT)], timeout=60, OUT=str(tmp_path))
    assert p.returncode == 0 and SKIP in p.stdout, (p.stdout, p.stderr)
    log = (tmp_path / "gpu_check.log").read_text()
    assert SKIP in log and last_line(log).startswith("gpu_check: PASS"), log


def test_script_runs_from_another_directory(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and SKIP in p.stdout, (p.stdout, p.stderr)


def test_script_dry_run_and_arguments():
    p = run(["bash", str(SCRIPT), "--dry-run"], timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "CUDASNAP_REQUIRE_CUDA=1" in out and "build_ext --inplace" in out, out
    assert "pytest -m gpu" in out and "tests/cuda/test_gpu_e2e.py" in out, out
    assert "bench/gpu_bench.py --budget" in out, out
    assert "detect:" in out and SKIP in out, out
    assert "preflight:" in out and "(budget 540 s" in out, out
    assert "--preflight" in out and "mode:   real GPU" in out, out
    assert last_line(out) == "gpu_check: PASS (dry run: nothing was built or run)", out
    p = run(["bash", str(SCRIPT), "--dry-run", "--quick"], timeout=60)
    assert p.returncode == 0 and "(budget 480 s" in p.stdout, p.stdout
    assert "worst case: 525 s" in p.stdout, p.stdout  # under the 10 minutes of a lent machine
    p = run(["bash", str(SCRIPT), "--help"])
    assert p.returncode == 0 and "--budget" in p.stdout and "--dry-run" in p.stdout, p.stdout
    assert "--emulated" in p.stdout and "gpu_check: PASS" in p.stdout, p.stdout
    for bad in (["--no-such-flag"], ["--budget", "soon"], ["--budget"]):
        p = run(["bash", str(SCRIPT), *bad])
        assert p.returncode == 2, (bad, p.stdout, p.stderr)
        assert last_line(p.stdout).startswith("gpu_check: FAIL (bad arguments"), (bad, p.stdout)
    assert "unknown argument" in run(["bash", str(SCRIPT), "--no-such-flag"]).stderr


@pytest.mark.slow
def test_emulated_dry_run_wiring():
    p = run(["bash", str(SCRIPT), "--dry-run", "--emulated"], timeout=60)
    out = p.stdout
    assert p.returncode == 0, (out, p.stderr)
    assert "mode:   EMULATED" in out and "NOT GPU figures" in out, out
    assert "tools/cudaemu/build.py" in out and "tools/cudaemu/run.sh" in out, out
    assert "tests/cuda_emu" in out and "-m gpu" not in out, out  # the emulated lane instead
    assert "--emulated" in out and "--cpu-smoke" not in out, out
    assert "as make build" in out and "CUDASNAP_REQUIRE_CUDA" not in out, out
    assert "detect: GPU found: EMULATED" in out, out
    assert "(budget 480 s" in out and last_line(out).startswith("gpu_check: PASS"), out
    p = run(["bash", str(SCRIPT), "--dry-run", "--emulated"], timeout=60,
            CUDASNAP_GPU_CHECK_FAKE="1")
    assert p.returncode == 2 and last_line(p.stdout).startswith("gpu_check: FAIL"), p.stdout


def sourced(expr: str) -> str:
    """Runs bash functions of the script (sourcing it runs nothing)."""
    p = subprocess.run(["bash", "-c", f"source {SCRIPT}; {expr}"], capture_output=True,
                       text=True, timeout=30, cwd=REPO)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_sourcing_the_script_runs_nothing():
    assert sourced("echo sourced") == "sourced"


def test_budget_arithmetic_fits_ten_minutes_with_real_floors():
    """Issue 21 item 4: whatever the build takes (up to its own limit), the tests get at
    least 150 s, the bench at least 60 s, and --quick ends by 525 s (< 600)."""
    assert sourced("default_budget 0 0; default_budget 1 0; default_budget 0 1") == "540\n480\n480"
    assert sourced("tests_timeout 0 1; tests_timeout 10000 1; tests_timeout 10000 0") == \
        "150\n240\n300"
    assert sourced("bench_budget 0 1 0; bench_budget 10000 1 0; bench_budget 10000 0 0; "
                   "bench_budget 10000 0 1") == "60\n150\n420\n90"
    assert sourced("build_timeout 0; build_timeout 470; build_timeout 10000") == "60\n215\n300"
    # every phase runs to its limit; the bench process ends by its budget + grace
    rows = sourced(
        'for quick in 1 0; do B=$(default_budget $quick 0); for env in 2 15; do '
        'for frac in 0 50 100; do L=$((B-env)); bt=$(build_timeout $L); b=$((bt*frac/100)); '
        'L=$((L-b-PREFLIGHT_S)); t=$(tests_timeout $L $quick); L=$((L-t)); '
        'n=$(bench_budget $L $quick 0); echo "$quick $B $t $n $((B-L+n+BENCH_GRACE_S)) '
        '$(worst_case $B)"; done; done; done')
    for row in rows.splitlines():
        quick, budget, tests, bench, end, worst = map(int, row.split())
        assert tests >= 150 and bench >= 60, row
        assert end <= worst == budget + 45, row
        if quick:
            assert worst <= LIMIT_S - 60, row  # a minute of margin on a lent machine
    # a quick run whose build took 90 s: the tests get 240 s, the bench 150 s
    assert sourced("tests_timeout $((480-10-90-20)) 1") == "240"
    assert sourced("bench_budget $((480-10-90-20-100)) 1 0") == "150"


def test_phase_status_counting():
    for ok in ("ok", "warning: PARTIAL (its watchdog stopped it)", "no GPU"):
        assert sourced(f'phase_is_bad "{ok}" && echo bad || echo fine') == "fine", ok
    for bad in ("FAILED rc=1", "not run (build failed)", "FAILED (torch sees no device)"):
        assert sourced(f'phase_is_bad "{bad}" && echo bad || echo fine') == "bad", bad


FAKE_PY = r"""#!/usr/bin/env bash
# A stand-in interpreter: answers each call gpu_check.sh makes, logs it with the emulator
# flag it saw.
echo "EMU=${CUDASNAP_EMULATED_CUDA:-0} $*" >> "$FAKE_LOG"
case "$1" in
  -c)
    case "$2" in
      *get_device_properties*) echo "GPU 1 x stand-in (sm_90, 1 GiB), torch 0.0, CUDA 13.0" ;;
      *torch.version.cuda*) echo "2.14.1+cu130 13.0" ;;
    esac
    exit 0 ;;
  tools/cudaemu/build.py) echo "$FAKE_LIB"; exit 0 ;;
  bench/gpu_bench.py)
    if [[ "$2" == --preflight ]]; then
      echo "fact cudaHostRegister: REFUSED (stand-in): a process-private pinned arena is used"
      echo "fact /dev/shm: 1.0 GiB, 0.5 GiB free"
      echo "fact MADV_POPULATE_WRITE: missing (EINVAL)"
      [[ -n "${FAKE_PREFLIGHT_SLEEP:-}" ]] && sleep "$FAKE_PREFLIGHT_SLEEP"
      exit "${FAKE_PREFLIGHT_RC:-0}"
    fi
    out=""
    while [[ $# -gt 0 ]]; do [[ "$1" == --out ]] && out=$2; shift; done
    echo "stand-in bench table" > "$out/gpu_results.txt"
    exit "${FAKE_BENCH_RC:-0}" ;;
  -m) echo "3 passed in 0.1s"; exit "${FAKE_TESTS_RC:-0}" ;;
esac
exit 0
"""


def libc_path() -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "/libc.so" in line or "/libc-" in line:
            return line.split()[-1]
    raise AssertionError("libc not mapped")


def fake_run(tmp_path: Path, *args: str, timeout: float = 120, **extra: str):
    py = tmp_path / "fakepy"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    out = tmp_path / "out"
    p = run(["bash", str(SCRIPT), "--no-build", *args], timeout=timeout, OUT=str(out),
            PYTHON=str(py), FAKE_LOG=str(log), FAKE_LIB=libc_path(), **extra)
    return p, log.read_text().splitlines(), out


def test_partial_bench_is_a_warning_and_facts_reach_the_table(tmp_path):
    p, calls, out = fake_run(tmp_path, "--quick", CUDASNAP_GPU_CHECK_FAKE="1", FAKE_BENCH_RC="3")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    last = last_line(p.stdout)
    assert last.startswith("gpu_check: PASS (") and "warning: bench PARTIAL" in last, last
    assert "cudaHostRegister: REFUSED (stand-in)" in p.stdout  # item 10: in the summary
    assert "MADV_POPULATE_WRITE: missing" in p.stdout
    md = (out / "gpu_check_table.md").read_text()
    assert "| cudaHostRegister | REFUSED (stand-in)" in md and "| /dev/shm | 1.0 GiB" in md, md
    assert "warning: PARTIAL" in md
    assert last_line((out / "gpu_check.log").read_text()) == last
    assert any("bench/gpu_bench.py --preflight --preflight-device cpu" in c for c in calls)
    assert any("--cpu-smoke" in c and "--quick" in c for c in calls), calls


@pytest.mark.slow
def test_failed_phase_makes_the_last_line_fail(tmp_path):
    p, _, _ = fake_run(tmp_path, CUDASNAP_GPU_CHECK_FAKE="1", FAKE_TESTS_RC="1")
    assert p.returncode == 1, p.stdout[-3000:]
    assert last_line(p.stdout).startswith("gpu_check: FAIL (failed: tests;"), p.stdout[-2000:]
    p, _, _ = fake_run(tmp_path, CUDASNAP_GPU_CHECK_FAKE="1", FAKE_PREFLIGHT_RC="1")
    assert p.returncode == 1 and "failed: preflight" in last_line(p.stdout), p.stdout[-2000:]


def test_emulated_run_wiring(tmp_path):
    """--emulated: the emulator is built, preflight / tests / bench run under it
    (tools/cudaemu/run.sh), the tests are the emulated lane, the bench is --emulated, the
    table says these are not GPU figures, and bench/RESULTS.md is left alone."""
    results = REPO / "bench" / "RESULTS.md"
    before = results.read_bytes()
    p, calls, out = fake_run(tmp_path, "--emulated")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-2000:])
    assert last_line(p.stdout).startswith("gpu_check: PASS (EMULATED, not a GPU result;")
    assert any(c.startswith("EMU=0 tools/cudaemu/build.py") for c in calls), calls
    pre = [c for c in calls if "--preflight" in c]
    tests = [c for c in calls if " -m pytest" in c]
    bench = [c for c in calls if "bench/gpu_bench.py --budget" in c]
    assert pre and tests and bench, calls
    assert all(c.startswith("EMU=1 ") for c in pre + tests + bench), calls  # under run.sh
    assert tests[0].endswith("tests/cuda_emu") and "-m gpu" not in tests[0], tests
    assert "--emulated" in bench[0], bench
    assert "mode: EMULATED" in p.stdout and "NOT GPU figures" in p.stdout
    md = (out / "gpu_check_table.md").read_text()
    assert "--emulated: NOT a GPU run" in md.splitlines()[0], md
    assert results.read_bytes() == before


def test_interrupted_run_still_ends_with_a_fail_line(tmp_path):
    """The trap: a run stopped from outside (SIGTERM to its process group) mid-phase."""
    py = tmp_path / "fakepy"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(SCRIPT), "--no-build"], cwd=REPO,
                            env=env(OUT=str(out), PYTHON=str(py), FAKE_LOG=str(tmp_path / "l"),
                                    CUDASNAP_GPU_CHECK_FAKE="1", FAKE_PREFLIGHT_SLEEP="30"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while "phase preflight" not in ((out / "gpu_check.log").read_text()
                                    if (out / "gpu_check.log").exists() else ""):
        assert time.monotonic() < deadline, "the preflight never started"
        time.sleep(0.2)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # what a tool's timeout does (the preflight sleeps 30 s)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, stdout
    assert time.monotonic() - t0 < 15, "the phase's command was not stopped with the script"
    last = last_line(stdout)
    assert last.startswith("gpu_check: FAIL (stopped with exit code 143 in phase preflight"), stdout
    assert last_line((out / "gpu_check.log").read_text()) == last


@pytest.mark.slow
def test_bench_compiles_and_helps_without_gpu(tmp_path):
    py_compile.compile(str(BENCH), cfile=str(tmp_path / "gpu_bench.pyc"), doraise=True)
    p = run([sys.executable, str(BENCH), "--help"])
    assert p.returncode == 0, p.stderr
    for flag in ("--budget", "--sections", "--quick", "--out", "--cpu-smoke", "--emulated",
                 "--preflight"):
        assert flag in p.stdout, flag
    p = run([sys.executable, str(BENCH), "--sections", "a,x"])
    assert p.returncode == 2 and "unknown section" in p.stderr, p.stderr
    p = run([sys.executable, str(BENCH), "--emulated", "--cpu-smoke"])
    assert p.returncode == 2 and "exclude each other" in p.stderr, p.stderr
    # --emulated without the emulator loaded (here: no device at all) is an error, not a skip
    p = run([sys.executable, str(BENCH), "--emulated", "--out", str(tmp_path)], timeout=120)
    assert p.returncode == 1 and "tools/cudaemu/run.sh" in p.stdout, (p.stdout, p.stderr)


@pytest.mark.slow
def test_bench_without_gpu_exits_0_with_skip_message(tmp_path):
    p = run([sys.executable, str(BENCH)], timeout=120, OUT=str(tmp_path))
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert SKIP in p.stdout, p.stdout
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def _watchdog_probe(setup: str, body: str, on_raise: str, *paths: str):
    """A child that arms gpu_bench's 1 s watchdog after ``setup``, runs ``body`` then
    sleeps 5 s (printing "no alarm"), and runs ``on_raise`` when BudgetExceeded arrives."""
    def indent(text: str) -> str:
        return "".join(f"    {line}\n" for line in text.splitlines())

    code = (f"import sys, time; sys.path[:0] = {[*paths, str(BENCH.parent)]!r}\n"
            "import gpu_bench as G\n" + setup + "G.install_watchdog(None, 1)\n"
            "try:\n" + indent(body) + "    time.sleep(5)\n    print('no alarm')\n"
            "except G.BudgetExceeded:\n" + indent(on_raise))
    return run([sys.executable, "-c", code], timeout=60)


@pytest.mark.slow
def test_watchdog_waits_for_a_running_import_to_finish(tmp_path):
    """The alarm must not raise inside an import (a C extension's init cannot carry the
    exception: CI saw torch's import abort the process); it fires once the import ends."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(1.6)\nDONE = True\n")
    p = _watchdog_probe("", "import slowmod",
                        "print('raised after import', sys.modules['slowmod'].DONE)",
                        str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "raised after import True", (p.stdout, p.stderr)


@pytest.mark.slow
def test_watchdog_raise_swallowed_in_a_weakref_callback_is_raised_again(tmp_path):
    """An alarm landing in a weakref callback is printed as "Exception ignored" and
    dropped (CI: a --budget 1 run ended "complete", exit 0); the watchdog raises again."""
    p = _watchdog_probe(
        "import weakref\nclass O: pass\no = O()\nr = weakref.ref(o, lambda _: time.sleep(2))\n",
        # the callback sleeps through the alarm: its raise is unraisable
        "del o\nprint('callback returned', flush=True)",
        "G.watchdog_caught()\nprint('raised again')")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["callback", "returned", "raised", "again"], (p.stdout, p.stderr)


@pytest.mark.slow
def test_bench_watchdog_prints_partial_results_and_exits_3(tmp_path):
    p = run([sys.executable, str(BENCH), "--cpu-smoke", "--budget", "1", "--boundaries",
             "100000000", "--out", str(tmp_path)], timeout=120)
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert "PARTIAL" in p.stdout.strip().splitlines()[-1], p.stdout
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    assert res["status"].startswith("PARTIAL"), res["status"]
    assert "PARTIAL" in (tmp_path / "gpu_results.txt").read_text()


@pytest.mark.slow
def test_every_phase_of_the_script_with_faked_detection(tmp_path):
    """CUDASNAP_GPU_CHECK_FAKE=1: detect passes, env + GPU tests (all skip) + the bench on
    the CPU backend run; --no-build keeps the built extension. Checks the outputs and that
    the summary table comes last."""
    out = tmp_path / "out"
    p = run(["bash", str(SCRIPT), "--no-build", "--budget", "400"], timeout=420,
            OUT=str(out), CUDASNAP_GPU_CHECK_FAKE="1")
    summary = p.stdout[p.stdout.find("gpu_check summary"):][:1500]  # the phase table
    assert p.returncode == 0, (summary, p.stdout[-4000:], p.stderr[-2000:])
    for name in ("gpu_check.log", "pytest.log", "gpu_tests.xml", "gpu_results.json",
                 "gpu_results.txt", "gpu_check_table.md"):
        assert (out / name).is_file(), name
    res = json.loads((out / "gpu_results.json").read_text())
    assert res["status"] == "complete" and not res["errors"], res
    for section in "abcd":
        assert res[section], f"section ({section}) produced no row"
    assert res["c"][0]["tensors"] == 1000, res["c"]
    lines = p.stdout.rstrip().splitlines()
    table = (out / "gpu_results.txt").read_text().rstrip().splitlines()
    assert lines[-len(table) - 1:-1] == table, "the bench table is not printed last"
    assert lines[-1].startswith("gpu_check: PASS (FAKE detection"), lines[-1]
    assert any("cudasnap gpu_check summary" in ln for ln in lines[-40:])
    assert "tests: " in p.stdout and "skipped" in p.stdout
    # the preflight ran (on the CPU backend here) before the tests, and reported /dev/shm
    assert "/dev/shm:" in p.stdout and "submit + fence + flush: ok" in p.stdout, p.stdout[-4000:]
    assert "fact snapshot: step 1 completed, flushed and restored bit for bit" in p.stdout
    assert p.stdout.index("phase preflight") < p.stdout.index("phase tests")
    md = (out / "gpu_check_table.md").read_text()
    assert md.startswith("### gpu_check 20") and "| preflight |" in md and "| tests |" in md, md
