"""Build script: a build_ext that configures and builds CMakeLists.txt.

Environment:
  CUDASNAP_CUDA_ARCHS    CUDA architectures, CMake syntax (default "90": H100/H200)
  CUDASNAP_REQUIRE_CUDA  "1": fail if the CUDA backend cannot be built (CI sets it)
  CUDASNAP_WITH_CUDA     "0": skip the CUDA backend (the CPU backend alone builds faster)
  CUDA_HOME              toolkit root (folder whose include/ holds cuda_runtime.h)
  CUDASNAP_BUILD_DIR     CMake build directory (default build/cmake)

The extension is built in CUDASNAP_BUILD_DIR/lib and copied to where setuptools
wants it, so a second build from the same checkout (``pip install -e .[s3]`` after
``pip install -e .``, ``make build`` after ``pip wheel``) compiles and links nothing.
Before compiling, the build prints what it builds and about how long it takes;
ninja's ``[k/N]`` lines follow (pip shows them with ``-v``).
"""
from __future__ import annotations

import fcntl
import filecmp
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import setuptools
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
from cuda_home import cuda_home as _cuda_home  # noqa: E402

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"
MIN_CMAKE = (3, 26)  # CMakeLists.txt's cmake_minimum_required
#: The README's build-tools line: what a fresh venv lacks for `pip install --no-build-isolation`.
BUILD_TOOLS = "pip install setuptools wheel pybind11 cmake ninja"

# setup.py commands that make a wheel (pip runs dist_info for the metadata, then
# bdist_wheel, or editable_wheel for -e), and those that compile.
_WHEEL_COMMANDS = {"dist_info", "bdist_wheel", "editable_wheel"}
_BUILD_COMMANDS = _WHEEL_COMMANDS | {"build", "build_ext", "install", "develop"}

# Build time estimate: CPU seconds of one compile measured on the 2-core dev
# machine (g++ 12, -O3, torch 2.14): a source that includes torch's, ATen's or
# pybind11's headers 7-17 s, any other about 1 s, a .cu file (nvcc) 3 s; the
# link (LTO) 10 s.
_HEAVY_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch/|ATen/|c10/|pybind11/|bindings\.h)', re.M)
_COST_HEAVY_S, _COST_LIGHT_S, _COST_CU_S, _COST_LINK_S = 12.0, 1.2, 3.0, 10.0
_HEARTBEAT_S = 30.0


def _say(msg: str) -> None:
    print(f"cudasnap: {msg}", flush=True)  # noqa: T201 - build output


def _cmake_exe() -> str | None:
    """The cmake the build uses: this environment's (pip's cmake package) first, then PATH."""
    return shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")


def _cmake_version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _has_bdist_wheel() -> bool:
    """setuptools 70.1 and later have bdist_wheel built in; before, the `wheel` package adds it."""
    return (importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
            or importlib.util.find_spec("wheel") is not None)


def missing_build_tools(commands: set[str]) -> list[str]:
    """What ``commands`` need that this environment lacks, one line each (empty: nothing)."""
    missing: list[str] = []
    if not commands & _BUILD_COMMANDS:
        return missing
    if commands & _WHEEL_COMMANDS and not _has_bdist_wheel():
        missing.append(f"wheel: setuptools {setuptools.__version__} has no bdist_wheel command of its own "
                       "(70.1 and later do), and pip builds and installs a wheel")
    if importlib.util.find_spec("pybind11") is None:
        missing.append("pybind11: the C++ bindings")
    exe = _cmake_exe()
    version = _cmake_version(exe) if exe else None
    if version is None or version < MIN_CMAKE:
        found = f"{exe} is {'.'.join(map(str, version))}" if exe and version else "none found"
        missing.append(f"cmake {MIN_CMAKE[0]}.{MIN_CMAKE[1]} or later ({found})")
    if importlib.util.find_spec("torch") is None:
        missing.append("torch 2.6 to 2.15, installed first: cudasnap builds against it")
    return missing


def check_build_tools(argv: list[str]) -> None:
    """Stop before any compiling, naming every missing build tool and the command that adds them."""
    missing = missing_build_tools(set(argv[1:]))
    if missing:
        lines = "\n".join(f"  - {m}" for m in missing)
        sys.exit(f"cudasnap: cannot build in this environment ({sys.executable}); missing:\n{lines}\n"
                 f"Install the build tools (and torch) into it, then run the same command again:\n"
                 f"    {BUILD_TOOLS}\n"
                 "and build without isolation (the extension is built against the installed torch):\n"
                 "    pip install --no-build-isolation <path to cudasnap>")


def _arch_names(archs: str) -> str:
    """CMake CUDA architectures ("80;90-real") as sm names ("sm_80, sm_90")."""
    names = [f"sm_{m.group(1)}" if (m := re.match(r"(\d+)", a.strip())) else a.strip()
             for a in archs.split(";") if a.strip()]
    return ", ".join(names) or archs


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(5, int(round(seconds / 5.0)) * 5)} s"
    return f"{seconds / 60:.0f} min" if seconds >= 150 else f"{seconds / 60:.1f} min"


def _cache_value(cache: Path, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}:[A-Z]+=(.*)$", cache.read_text(errors="replace"), re.M)
    return m.group(1).strip() if m else ""


def _pending(build_dir: Path) -> list[str] | None:
    """What ninja would run now ([k/N] descriptions); None when not a ninja build."""
    ninja = _cache_value(build_dir / "CMakeCache.txt", "CMAKE_MAKE_PROGRAM")
    if not (build_dir / "build.ninja").exists() or not ninja:
        return None
    try:
        p = subprocess.run([ninja, "-C", str(build_dir), "-n"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return [ln for ln in p.stdout.splitlines() if re.match(r"\[\d+/\d+\] ", ln)] if p.returncode == 0 else None


def estimate_seconds(steps: list[str], jobs: int) -> float:
    """About how long ``steps`` (ninja's [k/N] lines) take with ``jobs`` parallel compiles."""
    costs: list[float] = []
    link = 0.0
    for step in steps:
        m = re.search(r"Building (?:CXX|CUDA) object \S*?_C\.dir/(\S+)\.o", step)
        if m is None:
            link = _COST_LINK_S if "Linking" in step else link
            continue
        src = ROOT / m.group(1)
        if src.suffix == ".cu":
            costs.append(_COST_CU_S)
            continue
        try:
            heavy = _HEAVY_INCLUDE.search(src.read_text(errors="replace")) is not None
        except OSError:
            heavy = True
        costs.append(_COST_HEAVY_S if heavy else _COST_LIGHT_S)
    if not costs:
        return link
    return max(sum(costs) / max(1, jobs), max(costs)) + link


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:  # noqa: D102
        try:
            import pybind11
            import torch
        except ImportError as e:
            raise RuntimeError(
                f"cudasnap builds against the torch already installed in this environment ({e}); "
                "install torch (2.6 to 2.15) and the build tools first "
                f"(`{BUILD_TOOLS}`), then build without isolation: "
                "`pip install --no-build-isolation .`") from e

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(os.environ.get("CUDASNAP_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        # One fixed output folder: a build for another destination (a pip wheel's temporary
        # folder, --inplace, an editable install) then reuses it instead of relinking.
        lib_dir = build_dir / "lib"
        torch_dir = Path(torch.__file__).resolve().parent
        cuda_version = torch.version.cuda or ""
        rpath = []
        nv = torch_dir.parent / "nvidia"
        for sub in ("cu13/lib", "cuda_runtime/lib"):
            if (nv / sub).is_dir():
                rpath.append(str(nv / sub))
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DTORCH_INCLUDE_DIR={torch_dir / 'include'}",
            f"-DTORCH_LIB_DIR={torch_dir / 'lib'}",
            f"-DTORCH_CUDA_VERSION={cuda_version}",
            f"-DTORCH_VERSION_STRING={torch.__version__}",
            # torch's libstdc++ ABI (2.6's wheels: the old one): every source is built with it
            f"-DCUDASNAP_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DCUDASNAP_VERSION={VERSION}",
            f"-DCUDASNAP_CUDA_ARCHS={os.environ.get('CUDASNAP_CUDA_ARCHS', '90')}",
            f"-DCUDASNAP_EXTRA_RPATH={';'.join(rpath)}",
            "-DCUDASNAP_REQUIRE_CUDA=" + ("ON" if os.environ.get("CUDASNAP_REQUIRE_CUDA") == "1" else "OFF"),
            "-DCUDASNAP_WITH_CUDA=" + ("OFF" if os.environ.get("CUDASNAP_WITH_CUDA") == "0" else "ON"),
        ]
        cuda_home = _cuda_home()
        if cuda_home:
            args += [f"-DCUDAToolkit_ROOT={cuda_home}",
                     f"-DCMAKE_CUDA_COMPILER={cuda_home}/bin/nvcc"]
        if shutil.which("ninja") or (Path(sys.executable).parent / "ninja").exists():
            args.append("-GNinja")
            ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
            args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        cmake = _cmake_exe() or "cmake"
        # One build at a time per build directory (make build, pip wheel, a second make test).
        lock = open(build_dir / ".build.lock", "w")  # noqa: SIM115 - held until the build ends
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            self._cmake(cmake, build_dir, args)
            self._install(lib_dir / target.name, target)
        finally:
            lock.close()

    @staticmethod
    def _install(built: Path, target: Path) -> None:
        """Copy the built module to ``target``: unchanged bytes stay, else a new file is renamed
        over it (a process that has the old one loaded keeps its mapping intact)."""
        if not built.exists():
            raise RuntimeError(f"cudasnap: the build made no {built.name} in {built.parent} "
                               f"(found: {sorted(p.name for p in built.parent.glob('*'))})")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and filecmp.cmp(built, target, shallow=False):
            return
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copy2(built, tmp)
        os.replace(tmp, target)

    @staticmethod
    def _cmake(cmake: str, build_dir: Path, args: list[str]) -> None:
        cache = build_dir / "CMakeCache.txt"
        if not cache.exists() or os.environ.get("CUDASNAP_RECONFIGURE") == "1":
            _say(f"configuring the build in {build_dir} (CMake checks the C++ and CUDA compilers)")
            subprocess.check_call([cmake, "-S", str(ROOT), "-B", str(build_dir), *args])
        else:  # incremental: re-run configure only with changed cache values
            subprocess.check_call([cmake, "-S", str(ROOT), "-B", str(build_dir), *args],
                                  stdout=subprocess.DEVNULL)
        jobs = os.cpu_count() or 2
        steps = _pending(build_dir)
        if steps is not None and not steps:
            _say(f"the extension in {build_dir} is up to date: nothing to compile")
        else:
            _say(_plan_line(build_dir, steps, jobs))
        _build([cmake, "--build", str(build_dir), "-j", str(jobs)], total=len(steps or []))


def _plan_line(build_dir: Path, steps: list[str] | None, jobs: int) -> str:
    """The one line said before compiling: which backends, how much, about how long."""
    cache = build_dir / "CMakeCache.txt"
    backend = _cache_value(cache, "CUDASNAP_CUDA_BACKEND")
    if backend.startswith("ON"):
        what = (f"building the CUDA backend for {_arch_names(_cache_value(cache, 'CUDASNAP_CUDA_ARCHS'))} "
                "and the CPU backend")
        hint = "CUDASNAP_WITH_CUDA=0 builds the CPU backend only"
    else:
        reason = backend.partition(":")[2].strip() or "off"
        what = (f"building the CPU backend only ({reason})" if "CUDASNAP_WITH_CUDA" in reason
                else f"building the CPU backend only (no CUDA backend: {reason})")
        hint = "pip -v shows each step"
    if steps is None:
        return f"{what}: a few minutes; {hint}"
    n_src = sum(" object " in s for s in steps)
    busy = ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * jobs:
        busy = f", longer while other work shares them (load {load:.1f})"
    return (f"{what}: {n_src} source file(s), about {_duration(estimate_seconds(steps, jobs))} "
            f"on {jobs} idle core(s){busy}; {hint}")


def _build(cmd: list[str], total: int) -> None:
    """Run the build, passing its lines through; on a long silent step (a big file, the
    link) a line every 30 s says it is still going."""
    t0 = time.monotonic()
    last = [t0]
    done = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(5.0):
            now = time.monotonic()
            with lock:
                if now - last[0] >= _HEARTBEAT_S:
                    last[0] = now
                    of = f", {done[0]} of {total} steps done" if total else ""
                    _say(f"still building ({_duration(now - t0)} so far{of})")

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    beat = threading.Thread(target=heartbeat, name="cudasnap-build-heartbeat", daemon=True)
    beat.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                sys.stdout.write(line)
                sys.stdout.flush()
                last[0] = time.monotonic()
                m = re.match(r"\[(\d+)/\d+\] ", line)
                if m:
                    done[0] = int(m.group(1))
        rc = proc.wait()
    finally:
        stop.set()
        beat.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        raise RuntimeError(f"cudasnap: the CMake build failed (exit {rc}): the compiler's messages are above "
                           f"(`{' '.join(cmd)}` repeats it)")
    _say(f"built in {_duration(time.monotonic() - t0)}")


check_build_tools(sys.argv)

setup(
    name="cudasnap",
    version=VERSION,
    description="Just-in-time GPU checkpointing for PyTorch: one minibatch lost per failure",
    packages=find_packages(include=["cudasnap", "cudasnap.*"]),
    ext_modules=[Extension("cudasnap._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    # What cudasnap imports at run time. torch is whatever the environment has:
    # the extension is built against it (pip install --no-build-isolation).
    install_requires=[
        "torch>=2.6,<2.16",
        "numpy>=1.24",
        "nvidia-ml-py>=12.535",
        "tqdm>=4.64",
    ],
    extras_require={
        "lightning": ["lightning>=2.1"],
        "hf": ["transformers>=4.40", "accelerate>=0.30", "safetensors>=0.4"],
        "bench": ["matplotlib>=3.7"],
        "metrics": ["prometheus-client>=0.17"],
        "s3": ["fsspec>=2023.1", "s3fs>=2023.1"],
    },
    entry_points={"console_scripts": ["cudasnap=cudasnap.tools.cli:main"]},
)
