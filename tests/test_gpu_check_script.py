"""bench/gpu_check.sh and bench/gpu_bench.py without a GPU: syntax, help, the skip path,
the watchdog, and (slow) every phase of the script with the GPU detection faked.

The device run is unattended and one-shot, so what can break before it reaches the GPU
is checked here. CUDA_VISIBLE_DEVICES="" makes torch see no device even on a GPU
machine, so these tests mean the same everywhere.
"""
from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"
BENCH = REPO / "bench" / "gpu_bench.py"
SKIP = "skipped: no CUDA device"


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


def test_script_without_gpu_skips_fast_with_a_clear_message(tmp_path):
    p = run(["bash", str(SCRIPT)], timeout=60)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert SKIP in p.stdout, p.stdout
    assert "phase build" not in p.stdout  # detected before anything expensive
    # with $OUT the same, teed into $OUT/gpu_check.log
    p = run(["bash", str(SCRIPT)], timeout=60, OUT=str(tmp_path))
    assert p.returncode == 0 and SKIP in p.stdout, (p.stdout, p.stderr)
    assert SKIP in (tmp_path / "gpu_check.log").read_text()


def test_script_runs_from_another_directory(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and SKIP in p.stdout, (p.stdout, p.stderr)


def test_script_dry_run_and_arguments():
    p = run(["bash", str(SCRIPT), "--dry-run"], timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "CUDASNAP_REQUIRE_CUDA=1" in out and "build_ext --inplace" in out, out
    assert "pytest -m gpu" in out and "tests/test_gpu_e2e.py" in out, out
    assert "bench/gpu_bench.py --budget" in out, out
    assert "detect:" in out and SKIP in out, out
    assert "preflight:" in out and "(budget 540 s" in out, out
    p = run(["bash", str(SCRIPT), "--dry-run", "--quick"], timeout=60)
    assert p.returncode == 0 and "(budget 300 s" in p.stdout, p.stdout  # --quick fits 5 minutes
    p = run(["bash", str(SCRIPT), "--help"])
    assert p.returncode == 0 and "--budget" in p.stdout and "--dry-run" in p.stdout, p.stdout
    p = run(["bash", str(SCRIPT), "--no-such-flag"])
    assert p.returncode == 2 and "unknown argument" in p.stderr, (p.stdout, p.stderr)
    p = run(["bash", str(SCRIPT), "--budget", "soon"])
    assert p.returncode == 2, (p.stdout, p.stderr)


def test_bench_compiles_and_helps_without_gpu(tmp_path):
    py_compile.compile(str(BENCH), cfile=str(tmp_path / "gpu_bench.pyc"), doraise=True)
    p = run([sys.executable, str(BENCH), "--help"])
    assert p.returncode == 0, p.stderr
    for flag in ("--budget", "--sections", "--quick", "--out", "--cpu-smoke"):
        assert flag in p.stdout, flag
    p = run([sys.executable, str(BENCH), "--sections", "a,x"])
    assert p.returncode == 2 and "unknown section" in p.stderr, p.stderr


def test_bench_without_gpu_exits_0_with_skip_message(tmp_path):
    p = run([sys.executable, str(BENCH)], timeout=120, OUT=str(tmp_path))
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert SKIP in p.stdout, p.stdout
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_watchdog_waits_for_a_running_import_to_finish(tmp_path):
    """The alarm must not raise inside an import (a C extension's init cannot carry the
    exception: CI saw torch's import abort the process); it fires once the import ends."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(1.6)\nDONE = True\n")
    code = (
        f"import sys, time; sys.path[:0] = [{str(tmp_path)!r}, {str(BENCH.parent)!r}]\n"
        "import gpu_bench as G\n"
        "G.install_watchdog(None, 1)\n"
        "try:\n"
        "    import slowmod\n"
        "    time.sleep(5)\n"
        "    print('no alarm')\n"
        "except G.BudgetExceeded:\n"
        "    print('raised after import', sys.modules['slowmod'].DONE)\n"
    )
    p = run([sys.executable, "-c", code], timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "raised after import True", (p.stdout, p.stderr)


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
    assert lines[-len(table):] == table, "the bench table is not printed last"
    assert any("cudasnap gpu_check summary" in ln for ln in lines[-40:])
    assert "tests: " in p.stdout and "skipped" in p.stdout
    # the preflight ran (on the CPU backend here) before the tests, and reported /dev/shm
    assert "/dev/shm:" in p.stdout and "submit + fence + flush: ok" in p.stdout, p.stdout[-4000:]
    assert p.stdout.index("phase preflight") < p.stdout.index("phase tests")
    md = (out / "gpu_check_table.md").read_text()
    assert md.startswith("### gpu_check 20") and "| preflight |" in md and "| tests |" in md, md
