"""The emulated CUDA lane: tests that run the CUDA path under tools/cudaemu.

They run in their own pytest process with the emulated runtime preloaded
(``make test`` calls ``tools/cudaemu/run.sh python -m pytest tests/cuda_emu``);
the plain lane does not collect this folder (tests/conftest.py). Nothing here
skips: a test of this lane that cannot run is a failure.

``emu``: the emulator's control API (fault injection, counters) through ctypes;
every test starts and ends with the faults cleared.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest


class Emu:
    """ctypes view of tools/cudaemu's test control API (cudaemu_*)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)  # the preloaded emulator's symbols are global
        self._fault = lib.cudaemu_fault
        self._fault.argtypes = [ctypes.c_char_p]
        self._counter = lib.cudaemu_counter
        self._counter.argtypes = [ctypes.c_char_p]
        self._counter.restype = ctypes.c_ulonglong
        self._pinned = lib.cudaemu_is_pinned
        self._pinned.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.lib = lib

    def fault(self, spec: str) -> None:
        """Applies a fault spec (``sticky:API:N``, ``host_register:ERR``, ...; ``clear``)."""
        self._fault(spec.encode())

    def counter(self, name: str) -> int:
        """kernel_launches, copies, pinned_ranges, device_allocations, device_bytes,
        captures, or the call count of an API (``cudaMemcpyAsync``)."""
        return int(self._counter(name.encode()))

    def stream_id(self, stream: int) -> int:
        """cudaStreamGetId of a raw stream handle (``torch.cuda.Stream.cuda_stream``)."""
        sid = ctypes.c_ulonglong()
        fn = self.lib.cudaStreamGetId
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
        assert fn(stream, ctypes.byref(sid)) == 0
        return int(sid.value)

    def hold(self, stream: int) -> None:
        """The stream runs nothing more until :meth:`release` (deterministic "in flight")."""
        self.fault(f"hold:{self.stream_id(stream)}")

    def hold_at(self, stream: int, n: int) -> None:
        """The stream runs ``n`` more data ops (copies, kernels, busy ops; the event
        records and waits between them run too), then stops before the next data op
        until :meth:`release`: a hold point between a copy's phases."""
        self.fault(f"hold_at:{self.stream_id(stream)}:{n}")

    def release(self) -> None:
        self.fault("release")

    def waiters(self, stream: int) -> int:
        """Streams and host threads now blocked waiting for ``stream``."""
        fn = self.lib.cudaemu_waiters
        fn.argtypes = [ctypes.c_ulonglong]
        return int(fn(self.stream_id(stream)))

    def parked(self, stream: int) -> bool:
        """Whether ``stream`` sits idle at its hold point with work queued (everything
        before the hold point, markers included, has run)."""
        fn = self.lib.cudaemu_parked
        fn.argtypes = [ctypes.c_ulonglong]
        return int(fn(self.stream_id(stream))) == 1

    def wait_parked(self, stream: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not self.parked(stream):
            assert time.monotonic() < end, "the stream never reached its hold point"
            time.sleep(0.002)

    def waiting(self, stream: int, on: int | None = None) -> bool:
        """Whether ``stream`` is stopped at a wait for stream ``on`` (None: any stream)."""
        fn = self.lib.cudaemu_waiting
        fn.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
        other = 0 if on is None else self.stream_id(on)
        return int(fn(self.stream_id(stream), other)) == 1

    def busy(self, stream: int, us: int) -> None:
        """``us`` microseconds of device work on ``stream`` (a kernel that takes time)."""
        fn = self.lib.cudaemu_busy
        fn.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        assert fn(stream, us) == 0

    def release_when(self, stream: int, done: Callable[[], bool], *, waiter: int,
                     timeout: float = 60.0) -> threading.Thread:
        """Starts a thread that releases the held ``stream`` as soon as the stream
        ``waiter`` stops at a wait for it (a fence or dependency doing its job) or
        ``done()`` turns true (the code under test went on without waiting). Which came
        first decides what the test sees; neither is a race: nothing else moves while the
        stream is held, and only the named stream's wait counts (never a device-wide
        synchronisation elsewhere). Returns the thread (``.blocked``: whether it waited)."""
        t = threading.Thread(target=self._release_when, args=(stream, done, waiter, timeout),
                             daemon=True)
        t.blocked = False  # type: ignore[attr-defined]
        t.start()
        return t

    def _release_when(self, stream: int, done: Callable[[], bool], waiter: int,
                      timeout: float) -> None:
        me = threading.current_thread()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.waiting(waiter, stream):
                me.blocked = True  # type: ignore[attr-defined]
                break
            if done():
                break
            time.sleep(0.002)
        self.release()

    def is_pinned(self, addr: int, nbytes: int) -> bool:
        return bool(self._pinned(addr, nbytes))


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("CUDASNAP_EMULATED_CUDA") != "1":
        raise pytest.UsageError(
            "tests/cuda_emu runs only under the emulated CUDA runtime: "
            "tools/cudaemu/run.sh .venv/bin/python -m pytest tests/cuda_emu")


@pytest.fixture(scope="session")
def emu() -> Emu:
    try:
        e = Emu()
    except AttributeError as exc:  # not preloaded: a failure, never a skip
        pytest.fail(f"the emulated CUDA runtime is not loaded ({exc}); run under tools/cudaemu/run.sh")
    import torch

    assert torch.cuda.is_available(), "torch sees no CUDA device under the emulator"
    return e


@pytest.fixture(autouse=True)
def _clear_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "emu" in request.fixturenames:
        request.getfixturevalue("emu").fault("clear")
