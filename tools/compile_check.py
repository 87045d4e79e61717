#!/usr/bin/env python3
"""Compile-checks every C++/CUDA source in csrc/ against several torch releases.

The extension is built against the installed torch only; this check makes sure
it also compiles against the headers of other releases users have (issue 11:
the GPU image's torch 2.11, the newest on the index, the oldest supported).
For each release it fetches only the headers: ``pip download --no-deps`` of a
manylinux x86_64 wheel, unzips ``torch/include/*`` and ``torch/version.py``
into ``build/torch-headers/<version>/`` and deletes the wheel, so later runs
download nothing. Every ``.cpp`` is checked with ``g++ -fsyntax-only`` (twice
where it has a ``CUDASNAP_WITH_CUDA`` branch: CUDA and CPU-only torch builds),
every ``.cu`` with ``nvcc -c``. For the other releases only the sources whose
includes reach torch's headers are checked (the rest compile the same against
any torch); for the installed torch only the CPU-only-torch variants (the build
compiles everything else against it). Only the sources under ``csrc/python/`` get
Python's and pybind11's include paths: the engine must compile without them. A
version whose sources and flags already passed is skipped (stamp under
``build/compile-check/``). Any failure exits 1.

Usage: tools/compile_check.py [--torch 2.11.0,2.15.0] [--no-installed] [-j N]
Environment: CUDASNAP_COMPILE_CHECK_TORCH overrides the default release list.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PYTHON_SIDE = CSRC / "python"
# 2.11: the GPU image's torch; 2.15: newest on the index; 2.6: oldest supported.
DEFAULT_RELEASES = "2.6.0,2.11.0,2.15.0"
CXX_FLAGS = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def log(msg: str) -> None:
    print(f"compile_check: {msg}", flush=True)


def fetch_headers(version: str, cache: Path) -> Path:
    """Returns <cache>/<version>/torch/include, downloading the wheel once."""
    dest = cache / version
    inc = dest / "torch" / "include"
    if (dest / ".complete").exists():
        return inc
    shutil.rmtree(dest, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"torch=={version}",
               "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
               "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
               "--platform", "manylinux1_x86_64", "-d", tmp]
        log(f"torch {version}: downloading the wheel for its headers (once; cached in {dest})")
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:  # a configured mirror may lack old releases: try PyPI alone
            r = subprocess.run(cmd, capture_output=True, text=True,
                               env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        wheels = list(Path(tmp).glob("torch-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"cannot download torch=={version}: {r.stderr.strip()[-800:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            names = [n for n in z.namelist()
                     if n.startswith("torch/include/") or n == "torch/version.py"]
            z.extractall(dest, names)
        (dest / ".complete").write_text(wheels[0].name + "\n")
        log(f"torch {version}: {len(names)} header files from {wheels[0].name} "
            f"in {time.monotonic() - t0:.0f} s")
    return inc


def cuda_home() -> str | None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from cuda_home import cuda_home as find
    except ImportError:
        return None
    return find()


TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*<(torch|c10|ATen)/', re.M)
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def uses_torch_headers(src: Path, seen: set[Path] | None = None) -> bool:
    """Whether src or a csrc header it includes (transitively) includes torch/c10/ATen."""
    seen = seen if seen is not None else set()
    if src in seen or not src.exists():
        return False
    seen.add(src)
    text = src.read_text()
    if TORCH_INCLUDE.search(text):
        return True
    return any(uses_torch_headers((src.parent / inc).resolve(), seen) for inc in LOCAL_INCLUDE.findall(text))


def is_python_side(src: Path) -> bool:
    """Whether src is one of the bindings or the code that walks Python objects
    (csrc/python/); everything else is the engine, built without Python.h."""
    return PYTHON_SIDE in src.resolve().parents


def jobs_for(inc: Path, python_inc: str, pybind_inc: str, cuda: str | None,
             torch_only: bool, cpu_only: bool = False) -> list[tuple[str, list[str]]]:
    """(label, command) for each source and configuration; torch_only: only the
    sources whose include closure reaches torch's headers (the others compile the
    same against any torch and are checked with the installed one); cpu_only: only
    the CPU-only-torch variants (the build itself compiles the CUDA configuration)."""
    engine_includes = [f"-I{CSRC}", f"-I{inc}", f"-I{inc}/torch/csrc/api/include"]
    python_includes = [*engine_includes, f"-I{python_inc}", f"-I{pybind_inc}"]
    defs = ['-DCUDASNAP_VERSION="check"']
    cuda_defs = ["-DCUDASNAP_WITH_CUDA", '-DCUDASNAP_CUDA_VERSION_STRING="check"',
                 '-DCUDASNAP_CUDA_ARCHS="90"']
    cuda_inc = [f"-I{cuda}/include"] if cuda else []
    out: list[tuple[str, list[str]]] = []
    sources = sorted([*CSRC.rglob("*.cpp"), *CSRC.rglob("*.cu")])
    if torch_only:
        sources = [s for s in sources if uses_torch_headers(s.resolve())]
    for src in [s for s in sources if s.suffix == ".cpp"]:
        rel = str(src.relative_to(ROOT))
        is_cuda_file = src.parent.name == "cuda"
        includes = python_includes if is_python_side(src) else engine_includes
        if cuda and not cpu_only:
            out.append((rel, ["g++", *CXX_FLAGS, *includes, *cuda_inc, *defs, *cuda_defs, str(src)]))
        if not is_cuda_file and "CUDASNAP_WITH_CUDA" in src.read_text():
            out.append((rel + " (CPU-only torch)", ["g++", *CXX_FLAGS, *includes, *defs, str(src)]))
        elif not is_cuda_file and not cuda:
            out.append((rel, ["g++", *CXX_FLAGS, *includes, *defs, str(src)]))
    if cuda and not cpu_only:
        for src in [s for s in sources if s.suffix == ".cu"]:
            out.append((str(src.relative_to(ROOT)),
                        [f"{cuda}/bin/nvcc", "-std=c++20", "-arch=sm_90", "-c", "-o", os.devnull,
                         *engine_includes, *defs, *cuda_defs, str(src)]))
    return out


def fingerprint(version: str, commands: list[tuple[str, list[str]]]) -> str:
    h = hashlib.sha256(version.encode())
    for src in sorted([*CSRC.rglob("*.cpp"), *CSRC.rglob("*.h"), *CSRC.rglob("*.cu")]):
        h.update(str(src.relative_to(ROOT)).encode() + b"\0" + src.read_bytes())
    for _, cmd in commands:
        h.update("\0".join(cmd).encode())
    return h.hexdigest()[:20]


def run_one(label: str, cmd: list[str]) -> tuple[str, int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return label, r.returncode, r.stderr, time.monotonic() - t0


def check_version(version: str, inc: Path, pool: cf.Executor, stamps: Path, cuda: str | None,
                  python_inc: str, pybind_inc: str, torch_only: bool, cpu_only: bool = False) -> bool:
    commands = jobs_for(inc, python_inc, pybind_inc, cuda, torch_only, cpu_only)
    key = re.sub(r"[^0-9A-Za-z.]+", "-", version).strip("-")
    stamp = stamps / f"{key}-{fingerprint(version, commands)}.ok"
    if stamp.exists():
        log(f"torch {version}: {len(commands)} compiles passed before with these sources (cached)")
        return True
    t0 = time.monotonic()
    ok = True
    for label, rc, err, dt in pool.map(lambda c: run_one(*c), commands):
        if rc != 0:
            ok = False
            log(f"torch {version}: FAIL {label}\n{err.strip()[-4000:]}")
        else:
            log(f"torch {version}: ok   {label} ({dt:.1f} s)")
    if ok:
        stamps.mkdir(parents=True, exist_ok=True)
        for old in stamps.glob(f"{key}-*.ok"):
            old.unlink()
        stamp.write_text("ok\n")
    log(f"torch {version}: {'passed' if ok else 'FAILED'} ({len(commands)} compiles, "
        f"{time.monotonic() - t0:.0f} s)")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch", default=os.environ.get("CUDASNAP_COMPILE_CHECK_TORCH", DEFAULT_RELEASES),
                    help="comma-separated torch releases to fetch headers of (default %(default)s)")
    ap.add_argument("--no-installed", action="store_true", help="skip the installed torch's headers")
    ap.add_argument("--all-installed", action="store_true",
                    help="check every source against the installed torch too (the build does)")
    ap.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--cache", type=Path, default=ROOT / "build" / "torch-headers")
    args = ap.parse_args(argv)

    import pybind11

    python_inc = sysconfig.get_paths()["include"]
    cuda = cuda_home()
    if cuda is None:
        if os.environ.get("CUDASNAP_REQUIRE_CUDA") == "1":
            log("FAILED: CUDASNAP_REQUIRE_CUDA=1 but no CUDA toolkit found (set CUDA_HOME)")
            return 1
        log("no CUDA toolkit found: checking the CPU-only configuration (csrc/cuda skipped)")
    targets: list[tuple[str, Path | None]] = []
    if not args.no_installed:
        import torch

        targets.append((torch.__version__.split("+")[0] + " (installed)",
                        Path(torch.__file__).resolve().parent / "include"))
    targets += [(v.strip(), None) for v in args.torch.split(",") if v.strip()]
    args.cache.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for version, inc in targets:
            installed = version.endswith("(installed)")
            if installed and cuda is not None and not args.all_installed:
                log(f"torch {version}: the build compiles every source against it; checking the "
                    "CPU-only-torch configuration here (--all-installed: everything)")
            try:
                inc = inc or fetch_headers(version, args.cache)
            except (RuntimeError, OSError) as e:
                log(f"torch {version}: FAILED to fetch headers: {e}")
                failed.append(version)
                continue
            if not check_version(version, inc, pool, ROOT / "build" / "compile-check", cuda,
                                 python_inc, pybind11.get_include(), torch_only=not installed,
                                 cpu_only=installed and cuda is not None and not args.all_installed):
                failed.append(version)
    checked = ", ".join(v for v, _ in targets)
    if failed:
        log(f"FAILED for torch {', '.join(failed)} (checked: {checked})")
        return 1
    log(f"all sources compile against torch {checked}"
        f" ({'with' if cuda else 'without'} the CUDA backend)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
