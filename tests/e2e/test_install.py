"""The wheel installs into a fresh environment that already has torch, and every
CLI verb runs there, from outside the source tree (issue 11).

The new venv reuses the project's torch via a .pth file naming a directory of
symlinks into the project venv's site-packages: only torch, the wheel's declared
run-time requirements (Requires-Dist, no extras) and their dependencies. So a
module cudasnap imports without declaring it (tqdm before) is missing there, and
a declared one the environment cannot satisfy fails the install. Nothing is
downloaded: the wheel is built with --no-build-isolation from the same CMake
build directory as `make build` (incremental) and installed with --no-index.
"""
from __future__ import annotations

import fcntl
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONNOUSERSITE"] = "1"
    env.pop("PIP_FIND_LINKS", None)  # with --no-index: only what is installed may satisfy a requirement
    env["PIP_CONFIG_FILE"] = os.devnull  # (no find-links from a pip.conf either)
    env.setdefault("CUDASNAP_CUDA_ARCHS", "90")
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{cmd} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _closure(names: list[str]) -> set[str]:
    """Distributions needed by ``names`` (run-time requirements, markers evaluated)."""
    seen: set[tuple[str, str]] = set()
    todo = [(n, "") for n in names]
    while todo:
        name, extra = todo.pop()
        name = re.sub(r"[-_.]+", "-", name).lower()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                # torch's cuda-toolkit[cudart,...]: the extras' requirements too
                todo += [(req.name, e) for e in ("", *sorted(req.extras))]
    return {n for n, _ in seen}


def _link_dists(dists: set[str], site: Path, shadow: Path) -> None:
    for name in dists:
        dist = md.distribution(name)
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (shadow / top).exists():
                continue
            if (site / top).exists():
                (shadow / top).symlink_to(site / top)


def test_wheel_installs_into_a_venv_with_torch_and_every_verb_runs(tmp_path):
    venv, wheels, shadow, work = (tmp_path / n for n in ("venv", "wheels", "deps", "work"))
    for d in (wheels, shadow, work):
        d.mkdir()
    outside = _env(venv)
    (ROOT / "build").mkdir(exist_ok=True)
    with open(ROOT / "build" / ".install-test.lock", "w") as lock:  # one wheel build at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
              "--no-index", "-w", wheels, ROOT], cwd=ROOT, env=outside, timeout=900)
    (wheel,) = wheels.glob("cudasnap-*.whl")

    # torch + the wheel's declared run-time requirements, with their dependencies.
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    declared = [Requirement(v.strip()) for k, _, v in (ln.partition(":") for ln in meta.splitlines())
                if k == "Requires-Dist"]
    runtime = [r.name for r in declared if r.marker is None or r.marker.evaluate({"extra": ""})]
    assert {"torch", "numpy", "tqdm", "nvidia-ml-py"} <= set(runtime), runtime
    assert all(r.marker is not None for r in declared if r.name in ("lightning", "transformers"))
    site = Path(torch.__file__).resolve().parent.parent
    _link_dists(_closure(["torch", *runtime]), site, shadow)
    assert not list(shadow.glob("*cudasnap*")) and not (shadow / "lightning").exists()
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=outside)
    purelib = Path(subprocess.check_output(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=outside, text=True).strip())
    (purelib / "_project_torch.pth").write_text(f"{shadow}\n")
    # Dependencies come from what is installed (no index): install_requires must be met.
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
          "--no-index", wheel], cwd=tmp_path, env=outside)

    py, cli = venv / "bin" / "python", venv / "bin" / "cudasnap"
    p = _run([py, "-c", "import json, cudasnap, torch; print(json.dumps([cudasnap.__file__, "
              "torch.__file__, cudasnap.build_info()]))"], cwd=work, env=outside)
    mod_file, torch_file, info = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(mod_file).resolve().is_relative_to(purelib.resolve()), (
        f"the installed package must run, not the checkout: {mod_file}")
    assert not Path(mod_file).resolve().is_relative_to(ROOT)
    assert Path(torch_file).resolve() == Path(torch.__file__).resolve()
    assert info["torch_built_against"] == torch.__version__ and "cpu" in info["backends"]

    demo = work / "demo"
    p = _run([cli, "demo", "--json", "--steps", "12", "--fail-at", "7", "--hidden", "64",
              "--layers", "2", "--device", "cpu", "--workdir", demo], cwd=work, env=outside)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["bitwise_identical"] is True, r
    ckpt = demo / "ckpt"
    p = _run([cli, "inspect", ckpt, "--json"], cwd=work, env=outside)
    assert json.loads(p.stdout)
    p = _run([cli, "verify", ckpt], cwd=work, env=outside)  # needs tqdm: a real dependency
    _run([cli, "export", ckpt, work / "state.pt"], cwd=work, env=outside)
    assert (work / "state.pt").stat().st_size > 0
    _run([cli, "gc", "--dry-run"], cwd=work, env=outside)
    _run([cli, "health"], cwd=work, env=outside)
    _run([cli, "advise", "--gpus", "8", "--mtbf-hours", "5000", "--iter-seconds", "1",
          "--state-gb", "10"], cwd=work, env=outside)
    for verb in ("demo", "run", "inspect", "verify", "export", "gc", "health", "advise"):
        p = _run([cli, verb, "--help"], cwd=work, env=outside)
        assert "usage" in p.stdout.lower(), (verb, p.stdout)
    assert sysconfig.get_paths()["purelib"] != str(purelib)


# ----------------------------------------------------------------------------- a fresh venv, README only

FRESH = ROOT / "build" / "install-test-fresh"  # a fixed place: the CMake build there stays incremental


def _fresh_venv(shadow: Path) -> tuple[Path, dict[str, str]]:
    """A new ``python -m venv`` (pip and the setuptools ensurepip bundles, no ``wheel``) that
    sees the project's torch (and its dependencies, setuptools excepted) through a .pth file."""
    venv = FRESH / "venv"
    if venv.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONNOUSERSITE"] = "1"
    _run([sys.executable, "-m", "venv", venv], cwd=FRESH, env=env)
    shadow.mkdir()
    _link_dists(_closure(["torch"]), Path(torch.__file__).resolve().parent.parent, shadow)
    for p in shadow.iterdir():  # the venv's own setuptools is the one under test
        if p.name.startswith(("setuptools", "_distutils_hack", "pkg_resources", "wheel")):
            p.unlink()
    purelib = Path(subprocess.check_output(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env, text=True).strip())
    (purelib / "_project_torch.pth").write_text(f"{shadow}\n")
    return venv, env


def _readme_install_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Use it in your own environment")
    m = re.search(r"```bash\n(.*?)```", text[start:text.index("\n## ", start + 1)], re.S)
    assert m is not None, "README: no bash block under '## Use it in your own environment'"
    return m.group(1)


def test_fresh_venv_readme_install_works_and_a_missing_wheel_fails_early(tmp_path):
    """The README's install section, verbatim, in a fresh venv (torch present, as the README
    asks): first without its build-tools line, which must fail before any compiling and name
    the fix; then whole, which must build and import; then with an extra, which must compile
    and link nothing."""
    FRESH.mkdir(parents=True, exist_ok=True)
    with open(FRESH.parent / ".install-test-fresh.lock", "w") as lock:  # one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        venv, env = _fresh_venv(tmp_path / "deps")
        py = venv / "bin" / "python"
        probe = ("import importlib.util as u; print(u.find_spec('wheel') is None, "
                 "u.find_spec('setuptools.command.bdist_wheel') is None)")
        no_wheel, no_builtin = _run([py, "-c", probe], cwd=tmp_path, env=env).stdout.split()
        assert no_wheel == "True", "a fresh venv has no wheel"
        env["CUDASNAP_BUILD_DIR"] = str(FRESH / "cmake")
        env["CUDASNAP_WITH_CUDA"] = "0"  # the CPU backend: the same build steps, minutes less
        env.pop("CUDASNAP_REQUIRE_CUDA", None)  # CI's .ci/run sets it; this build is CPU-only
        block = _readme_install_block().replace("/path/to/cudasnap", str(ROOT))
        tools, install = block.split("\n", 1)
        assert tools.startswith("pip install ") and " wheel " in tools, tools

        if no_builtin == "True":  # setuptools < 70.1 (3.11's bundled 65.5): the issue's failure
            p = subprocess.run(["bash", "-c", install], cwd=tmp_path, env=env, text=True,
                               capture_output=True, timeout=600)
            out = p.stdout + p.stderr
            assert p.returncode != 0, out[-3000:]
            assert "invalid command 'bdist_wheel'" not in out, out[-3000:]
            assert "wheel: setuptools" in out and "pip install setuptools wheel pybind11 cmake ninja" in out, \
                out[-3000:]
            assert "Building CXX" not in out and "configuring the build" not in out, "compiled before failing"

        p = _run(["bash", "-c", block], cwd=tmp_path, env=env, timeout=1800)
        out = p.stdout + p.stderr
        assert re.search(r"cudasnap: (building the CPU backend only|the extension in .* is up to date)", out), \
            out[-3000:]
        info = _run([py, "-c", "import cudasnap, json; print(json.dumps(cudasnap.build_info()))"],
                    cwd=tmp_path, env=env).stdout.strip().splitlines()[-1]
        assert json.loads(info)["backends"] == ["cpu"], info

        # An extra afterwards: the build is reused, nothing compiled or linked (--no-deps:
        # the extra's own packages are the README's other way and need the index).
        p = _run([venv / "bin" / "pip", "install", "-v", "--no-build-isolation", "--no-deps", f"{ROOT}[s3]"],
                 cwd=tmp_path, env=env)
        out = p.stdout + p.stderr
        assert "nothing to compile" in out and "Linking" not in out, out[-3000:]
