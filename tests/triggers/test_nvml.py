"""Tests for cudasnap.triggers.nvml / nvml_source (no GPU needed: NVML is faked where used)."""

from __future__ import annotations

import logging
import time
import types
from pathlib import Path
from typing import Any

import pytest
from helpers import parts
from helpers.triggers import Collector, clean_trigger_env  # noqa: F401 (autouse fixture)

from cudasnap.triggers import nvml as _nvml
from cudasnap.triggers.monitor import HealthMonitor
from cudasnap.triggers.nvml_source import NvmlSource

REPO = Path(__file__).resolve().parents[2]


def _real_nvml_works() -> bool:
    return _nvml.init() is None and (_nvml.shutdown() or True)


def test_nvml_unavailable_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    if _real_nvml_works():
        pytest.skip("a real NVML driver is present")
    caplog.set_level(logging.DEBUG, logger="cudasnap.health")
    a = NvmlSource(lambda t: None)
    b = NvmlSource(lambda t: None)
    assert not a.available and not b.available
    # INFO on a CPU-only machine, WARNING where CUDA devices are in use (tests/triggers/test_nvml_once.py)
    want = logging.WARNING if parts.cuda_in_use() else logging.INFO
    lines = [r for r in caplog.records if r.levelno == want and "NVML unavailable" in r.getMessage()]
    assert len(lines) == 1
    msg = lines[0].getMessage()
    assert "GPU health triggers disabled, signal/watchdog/exception triggers remain active" in msg
    assert "LibraryNotFound" in msg or "not installed" in msg
    mon = HealthMonitor(lambda t: None)
    assert not mon.available and not mon.injected
    mon.start()
    mon.notify_step(1)
    assert mon.should_hang(1) is False
    assert mon.describe().startswith("NVML unavailable")
    mon.stop()
    mon.stop()  # idempotent
    with pytest.raises(RuntimeError, match="NVML unavailable"):
        _nvml.read_gpu_status()


# ----------------------------------------------------------------------------- fake NVML

def make_fake_nvml(n_gpus: int = 2) -> types.ModuleType:
    m = types.ModuleType("fake_pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    def sub(name: str, value: int) -> type:
        cls = type(name, (NVMLError,), {"__init__": lambda self, *a: NVMLError.__init__(self, value)})
        setattr(m, name, cls)
        return cls

    m.NVMLError = NVMLError
    m.NVML_SUCCESS = 0
    m.NVML_ERROR_NOT_SUPPORTED, m.NVML_ERROR_TIMEOUT, m.NVML_ERROR_GPU_IS_LOST = 3, 10, 15
    m.NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NotSupported = sub("NVMLError_NotSupported", 3)
    Timeout = sub("NVMLError_Timeout", 10)
    GpuIsLost = sub("NVMLError_GpuIsLost", 15)
    m.LibNotFound = sub("NVMLError_LibraryNotFound", 12)
    m.nvmlEventTypeDoubleBitEccError, m.nvmlEventTypeXidCriticalError = 0x2, 0x8
    m.nvmlEventTypeGpuUnavailableError = 0x4000
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC, m.NVML_TEMPERATURE_GPU = 1, 0, 0
    m.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    m.nvmlClocksEventReasonGpuIdle, m.nvmlClocksEventReasonSwPowerCap = 0x1, 0x4
    m.nvmlClocksEventReasonHwSlowdown, m.nvmlClocksEventReasonSwThermalSlowdown = 0x8, 0x20
    m.nvmlClocksEventReasonHwThermalSlowdown, m.nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x40, 0x80

    handles = [f"gpu-handle-{i}" for i in range(n_gpus)]
    m.handles = handles
    m.state = {"ecc": {h: 5 for h in handles}, "remap": {h: (0, 0, 0, 0) for h in handles},
               "recovery": {h: 0 for h in handles}, "clocks": {h: 0 for h in handles},
               "lost": set(), "events": [], "calls": [], "unlocked_calls": [], "init_fail": False,
               "registered": [], "no_recovery": {handles[-1]}, "no_unavailable_event": {handles[-1]}}
    st = m.state

    def api(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            st["calls"].append((fn.__name__, args))
            if not _nvml.LOCK._is_owned():  # every NVML call must hold the module lock
                st["unlocked_calls"].append(fn.__name__)
            if args and args[0] in st["lost"]:
                raise GpuIsLost()
            return fn(*args)
        wrapper.__name__ = fn.__name__
        setattr(m, fn.__name__, wrapper)
        return wrapper

    @api
    def nvmlInit() -> None:
        if st["init_fail"]:
            raise m.LibNotFound()

    @api
    def nvmlShutdown() -> None: ...

    @api
    def nvmlDeviceGetCount() -> int:
        return n_gpus

    @api
    def nvmlDeviceGetHandleByIndex(i: int) -> str:
        return handles[i]

    @api
    def nvmlDeviceGetName(h: str) -> bytes:
        return b"Fake H200"

    @api
    def nvmlDeviceGetTemperature(h: str, sensor: int) -> int:
        return 41

    @api
    def nvmlEventSetCreate() -> str:
        return "event-set"

    @api
    def nvmlEventSetFree(s: str) -> None: ...

    @api
    def nvmlDeviceRegisterEvents(h: str, types_: int, s: str) -> None:
        if types_ == m.nvmlEventTypeGpuUnavailableError and h in st["no_unavailable_event"]:
            raise NotSupported()
        st["registered"].append((h, types_))

    @api
    def nvmlEventSetWait_v2(s: str, timeout_ms: int) -> Any:
        if st["events"]:
            return st["events"].pop(0)
        time.sleep(0.002)
        raise Timeout()

    @api
    def nvmlDeviceGetTotalEccErrors(h: str, etype: int, counter: int) -> int:
        assert (etype, counter) == (1, 0)
        return st["ecc"][h]

    @api
    def nvmlDeviceGetRemappedRows(h: str) -> tuple[int, int, int, int]:
        return st["remap"][h]

    @api
    def nvmlDeviceGetFieldValues(h: str, ids: list[int]) -> list[Any]:
        assert ids == [230]
        ret = 3 if h in st["no_recovery"] else 0
        return [types.SimpleNamespace(fieldId=230, valueType=1, nvmlReturn=ret,
                                      value=types.SimpleNamespace(uiVal=st["recovery"][h]))]

    @api
    def nvmlDeviceGetCurrentClocksEventReasons(h: str) -> int:
        return st["clocks"][h]

    def event(handle: str, etype: int, data: int = 0) -> None:
        st["events"].append(types.SimpleNamespace(device=handle, eventType=etype, eventData=data))

    m.event = event
    return m


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = make_fake_nvml()
    monkeypatch.setattr(_nvml, "pynvml", mod)
    return mod


def test_fake_init_failure_is_unavailable(fake: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    fake.state["init_fail"] = True
    caplog.set_level(logging.INFO, logger="cudasnap.health")
    src = NvmlSource(lambda t: None)
    NvmlSource(lambda t: None)
    assert not src.available and "LibraryNotFound" in (src.reason or "")
    assert sum("NVML unavailable" in r.getMessage() for r in caplog.records) == 1
    src.start()  # no-op
    src.stop()


def test_nvml_source_turns_nvml_faults_into_triggers(fake: types.ModuleType) -> None:
    got = Collector()
    st = fake.state
    st["ecc"][fake.handles[1]] = 7                       # pre-existing errors: baseline, not a trigger
    src = NvmlSource(got, poll_interval=3600)            # poll thread idle; we call poll_once() ourselves
    assert src.available
    src.start()
    try:
        src.notify_step(40)
        assert "XidCriticalError" in src.describe()
        # GpuUnavailable registration NotSupported on GPU 1 was skipped, the rest registered.
        assert (fake.handles[1], 0x4000) not in st["registered"]
        assert (fake.handles[0], 0x4000) in st["registered"] and (fake.handles[1], 0x8) in st["registered"]

        fake.event(fake.handles[0], fake.nvmlEventTypeXidCriticalError, 79)
        fake.event(fake.handles[1], fake.nvmlEventTypeDoubleBitEccError)
        trig = got.wait_for(2)
        assert (trig[0].kind, trig[0].device, trig[0].code, trig[0].xid_class, trig[0].step) == \
            ("xid", 0, 79, "fatal", 40)
        assert (trig[1].kind, trig[1].device) == ("ecc_dbe", 1)

        src.poll_once()
        assert len(got.items) == 2                       # nothing changed -> nothing emitted

        st["ecc"][fake.handles[1]] = 9                   # +2 uncorrected
        st["remap"][fake.handles[0]] = (0, 1, 0, 1)      # remap failure
        st["clocks"][fake.handles[0]] = 0x40 | 0x1       # HW thermal slowdown (+ idle, ignored)
        st["clocks"][fake.handles[1]] = 0x4              # SW power cap alone: not a slowdown
        st["recovery"][fake.handles[0]] = 2
        src.poll_once()
        new = [(t.kind, t.device, t.code) for t in got.items[2:]]
        assert ("ecc_uncorrected", 1, 2) in new
        assert ("remap_failure", 0, None) in new
        assert ("thermal", 0, 0x40) in new
        assert ("recovery_action", 0, 2) in new
        assert len(new) == 4

        src.poll_once()                                  # edge-triggered: no repeats
        assert len(got.items) == 6

        st["lost"].add(fake.handles[1])
        src.poll_once()
        src.poll_once()
        lost = [t for t in got.items if t.kind == "gpu_lost"]
        assert [(t.device, t.step) for t in lost] == [(1, 40)]   # reported once
        # recovery-action field is NotSupported on GPU 1: queried once at baseline, then disabled
        fv = [a for n, a in st["calls"] if n == "nvmlDeviceGetFieldValues" and a[0] == fake.handles[1]]
        assert len(fv) == 1
    finally:
        src.stop()
    assert st["unlocked_calls"] == []
    assert ("nvmlShutdown", ()) in st["calls"]


def test_nvml_poll_thread_and_gpu_unavailable_event(fake: types.ModuleType) -> None:
    got = Collector()
    mon = HealthMonitor(got, poll_interval=0.01)
    assert isinstance(mon.source, NvmlSource) and mon.available
    mon.start()
    try:
        fake.state["remap"][fake.handles[1]] = (0, 0, 1, 0)
        assert got.wait_for(1)[0].kind == "remap_pending"
        fake.event(fake.handles[0], fake.nvmlEventTypeGpuUnavailableError)
        t = got.wait_for(2)[1]
        assert (t.kind, t.device) == ("gpu_lost", 0)
    finally:
        mon.stop()
    mon.stop()
    assert fake.state["unlocked_calls"] == []


def test_cuda_visible_devices_limits_monitored_gpus(fake: types.ModuleType,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    src = NvmlSource(lambda t: None, poll_interval=3600)
    assert [i for i, _ in src.handles] == [1]
    assert [i for i, _ in NvmlSource(lambda t: None, devices=[0, 1]).handles] == [0, 1]


def test_read_gpu_status_with_fake(fake: types.ModuleType) -> None:
    fake.state["remap"][fake.handles[0]] = (3, 1, 0, 0)
    rows = _nvml.read_gpu_status()
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[0]["name"] == "Fake H200" and rows[0]["temperature"] == 41
    assert rows[0]["ecc_uncorrected"] == 5 and rows[0]["recovery_action"] == 0
    assert rows[0]["remapped_rows"] == {"correctable": 3, "uncorrectable": 1, "pending": 0, "failure": 0}
    assert rows[1]["recovery_action"] is None        # NotSupported
    fake.state["lost"].add(fake.handles[1])
    assert _nvml.read_gpu_status()[1]["error"] == "GPU is lost"
    assert fake.state["unlocked_calls"] == []
