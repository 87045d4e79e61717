"""Build script: a build_ext that configures and builds CMakeLists.txt.

Environment:
  CUDASNAP_CUDA_ARCHS    CUDA architectures, CMake syntax (default "90": H100/H200)
  CUDASNAP_REQUIRE_CUDA  "1": fail if the CUDA backend cannot be built (CI sets it)
  CUDASNAP_WITH_CUDA     "0": skip the CUDA backend
  CUDA_HOME              toolkit root (folder whose include/ holds cuda_runtime.h)
  CUDASNAP_BUILD_DIR     CMake build directory (default build/cmake)
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
from cuda_home import cuda_home as _cuda_home  # noqa: E402

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:  # noqa: D102
        try:
            import pybind11
            import torch
        except ImportError as e:
            raise RuntimeError(
                f"cudasnap builds against the torch already installed in this environment ({e}); "
                "install torch (2.6 to 2.15) and pybind11 first, then build without isolation: "
                "`pip install --no-build-isolation .`") from e

        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("CUDASNAP_BUILD_DIR", ROOT / "build" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)
        torch_dir = Path(torch.__file__).resolve().parent
        cuda_version = torch.version.cuda or ""
        rpath = []
        nv = torch_dir.parent / "nvidia"
        for sub in ("cu13/lib", "cuda_runtime/lib"):
            if (nv / sub).is_dir():
                rpath.append(str(nv / sub))
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}",
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
        cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or "cmake"
        # One build at a time per build directory (make build, pip wheel, a second make test).
        lock = open(build_dir / ".build.lock", "w")  # noqa: SIM115 - held until the build ends
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            self._cmake(cmake, build_dir, args)
        finally:
            lock.close()

    @staticmethod
    def _cmake(cmake: str, build_dir: Path, args: list[str]) -> None:
        cache = build_dir / "CMakeCache.txt"
        if not cache.exists() or os.environ.get("CUDASNAP_RECONFIGURE") == "1":
            subprocess.check_call([cmake, "-S", str(ROOT), "-B", str(build_dir), *args])
        else:  # incremental: re-run configure only with changed cache values
            subprocess.check_call([cmake, "-S", str(ROOT), "-B", str(build_dir), *args],
                                  stdout=subprocess.DEVNULL)
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call([cmake, "--build", str(build_dir), "-j", jobs])


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
