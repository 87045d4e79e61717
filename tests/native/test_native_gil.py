"""The extension's GIL discipline and build flags (issue 21 items 1 and 9).

Item 1: a binding that releases the GIL must not make, return or drop a Python
object meanwhile; the first registration (``register_arena``) crashed the process
that way. The bindings run in a child process, so a crash is a failure here, not
the end of the test run. The build also enables pybind11's GIL assertion on
reference counts (CMakeLists.txt), so such a bug fails loudly wherever it runs.

Item 9: every C++/CUDA source is built with torch's ``_GLIBCXX_USE_CXX11_ABI``
(torch 2.6's wheels use the old ABI: a mismatched module cannot load).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("CUDASNAP_BUILD_DIR", ROOT / "build" / "cmake"))


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.slow
def test_register_read_only_arena_returns_reason(native_C, snap_env) -> None:
    """Item 1's reproduction: exit 139 (the tuple was made without the GIL) before."""
    if not hasattr(native_C, "register_arena"):
        pytest.skip("the extension was built without the CUDA backend (BUILD_INFO backends: "
                    f"{native_C.BUILD_INFO['backends']}); CI builds it with CUDASNAP_REQUIRE_CUDA=1")
    path = snap_env.scratch_arena("ro")
    native_C.Arena.create(str(path), 2, 1 << 20, 1 << 16, 1 << 16, "gil", False)
    r = run_child(f"""
        from cudasnap._native import native
        C = native()
        a = C.Arena.open({str(path)!r}, False)
        res = C.register_arena(a, 0)
        print(repr(res))
        res = C.register_arena(a)
        print(repr(res))
        C.unregister_arena(a)
        print("ok")
    """)
    assert r.returncode == 0, f"child exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    assert lines[-1] == "ok"
    for line in lines[:2]:
        ok, reason = eval(line)  # noqa: S307 - our own child's repr of (bool, str)
        assert ok is False and "read-only" in reason and str(path) in reason


@pytest.mark.slow
def test_gil_released_bindings_run(native_C, snap_env, tmp_path) -> None:
    """Every CPU binding that releases the GIL, once, in a child process (the CUDA ones:
    tests/cuda_emu/test_native_cuda.py)."""
    path = snap_env.scratch_arena("gil")
    r = run_child(f"""
        import ctypes, os, threading
        from cudasnap._native import native
        C = native()
        CH = 1 << 16
        cancel = C.CancelFlag()
        a = C.Arena.create({str(path)!r}, 2, 1 << 20, 1 << 16, CH, "gil", False, cancel)
        a.prefault(cancel)
        b = C.Arena.open({str(path)!r}, True, False)
        src = bytearray(os.urandom(3 * CH + 5))
        ptr = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
        assert C.crc32c(src) == C.crc32c_ptr(ptr, len(src)) == C._crc32c_impl(src, "portable")
        dst = bytearray(len(src))
        assert C.crc32c_copy(dst, src) == C.crc32c(src) and dst == src
        plan = C.build_plan([ptr], [len(src)], [1], [True], CH)
        eng = C.CpuCopyEngine(2)
        job = eng.submit(a, 0, plan, 3, [b'{{"x":', b"1}}"], 0, None)
        assert eng.fence(job, 1, 0)
        assert job.wait(1, 60) and not job.failed, job.error
        out = {str(tmp_path / "slot.bin")!r}
        a.lease(0)
        st = C.write_slot_file(a, 0, out, 2, 1 << 20, True)
        a.release(0)
        assert st["bytes"] >= len(src)
        C.fsync_dir({str(tmp_path)!r})
        table = a.read_table(0)
        back = bytearray(plan.total_bytes)
        bp = ctypes.addressof((ctypes.c_char * len(back)).from_buffer(back))
        C.read_file_verified(out, bp, plan.total_bytes, CH, table, 2)
        assert C.verify_buffer(a.data_ptr(0), plan.total_bytes, CH, table, 2) == -1
        assert C.copy_spans(a.data_ptr(0), plan.total_bytes, [(bp, 0, 16)], 2) == 16
        w = C.write_buffer_file(a.data_ptr(0), plan.total_bytes, CH, out + ".2", 2, 1 << 20, False)
        assert w["bytes"] == plan.total_bytes
        assert eng.shutdown(10)
        reg = C.AllocatorRegistry()
        reg.record("segment_alloc", 0, 1 << 20, 1 << 20, 0, (0, 0))
        reg.record("alloc", 0, 1 << 20, 4096, 0, (0, 0))
        reg.drain()
        reg.seed(1, [{{"address": 1 << 30, "total_size": 1 << 20, "blocks": []}}])
        reg.coverage(0, [(1 << 20, 4096)])
        reg.start_auto_drain(8)
        reg.wait_auto_drained(5.0)
        reg.stop_auto_drain()
        # the same calls from threads racing the GIL
        ts = [threading.Thread(target=lambda: [C.crc32c(src) for _ in range(200)]) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        del a, b, eng, job, plan, reg
        print("ok")
    """)
    assert r.returncode == 0, f"child exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.splitlines()[-1] == "ok"


def _compile_commands() -> list[dict[str, str]]:
    cache = BUILD_DIR / "CMakeCache.txt"
    if not cache.exists():
        pytest.skip(f"no CMake build in {BUILD_DIR} (installed from a wheel?)")
    cc = BUILD_DIR / "compile_commands.json"
    assert cc.exists(), f"{cc} missing: CMakeLists.txt must set CMAKE_EXPORT_COMPILE_COMMANDS"
    return json.loads(cc.read_text())


def test_every_source_is_built_with_torchs_cxx11_abi() -> None:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    entries = _compile_commands()
    cache = (BUILD_DIR / "CMakeCache.txt").read_text()
    assert f"CUDASNAP_CXX11_ABI:STRING={abi}\n" in cache
    built = {}
    for e in entries:
        f = Path(e["file"]).resolve()
        if ROOT / "csrc" in f.parents:
            args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
            built[f.relative_to(ROOT).as_posix()] = args
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*")
               if p.suffix in (".cpp", ".cu")}
    from cudasnap._native import native

    with_cuda = "cuda" in native().BUILD_INFO["backends"]
    want = sources if with_cuda else {s for s in sources if not s.startswith("csrc/cuda/")}
    assert want <= set(built), f"not in compile_commands.json: {sorted(want - set(built))}"
    for src, args in sorted(built.items()):
        flags = [a for a in args if "_GLIBCXX_USE_CXX11_ABI" in a]
        assert flags == [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"], (src, flags)
        assert "-DPYBIND11_ASSERT_GIL_HELD_INCREF_DECREF" in args, src
