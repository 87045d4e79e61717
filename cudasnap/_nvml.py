"""Low-level NVML access for cudasnap's health monitor.

Everything that touches NVML goes through :func:`call`, which holds the single
module-level :data:`LOCK` for the duration of the NVML call.  The pynvml module
object is looked up at call time via the module attribute :data:`pynvml`, so
tests can substitute a fake, pynvml-shaped module with ``monkeypatch``.

:class:`NvmlBackend` contains the event thread and the poll thread.  It is
independent of the :class:`cudasnap.health.Trigger` type: detections are
reported through :meth:`NvmlBackend._emit`, which ``cudasnap.health.NvmlSource``
overrides.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger("cudasnap.health")

try:  # pragma: no cover - depends on the environment
    import pynvml as _real_pynvml

    pynvml: ModuleType | None = _real_pynvml
except ImportError:  # pragma: no cover
    pynvml = None

#: The one lock every NVML call is made under.
LOCK = threading.RLock()

_warned_lock = threading.Lock()
_warned_unavailable = False

#: Clock-event (throttle) reason bits treated as a thermal/power slowdown.
_SLOWDOWN_BITS = ("HwSlowdown", "HwThermalSlowdown", "SwThermalSlowdown", "HwPowerBrakeSlowdown")

_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def module() -> ModuleType:
    """Return the pynvml module in use, or raise RuntimeError if it is not installed."""
    mod = pynvml
    if mod is None:
        raise RuntimeError("pynvml (nvidia-ml-py) is not installed")
    return mod


def const(name: str, default: Any = None) -> Any:
    """Return a pynvml constant by name, or ``default`` if this pynvml lacks it."""
    mod = pynvml
    return default if mod is None else getattr(mod, name, default)


def call(fn_name: str, *args: Any) -> Any:
    """Call ``pynvml.<fn_name>(*args)`` under :data:`LOCK`."""
    mod = module()
    fn = getattr(mod, fn_name)
    with LOCK:
        return fn(*args)


def has(fn_name: str) -> bool:
    return pynvml is not None and callable(getattr(pynvml, fn_name, None))


def _err_is(exc: BaseException, class_name: str, code_name: str) -> bool:
    cls = const(class_name)
    if isinstance(cls, type) and isinstance(exc, cls):
        return True
    code = const(code_name)
    return code is not None and getattr(exc, "value", object()) == code


def is_nvml_error(exc: BaseException) -> bool:
    base = const("NVMLError")
    return isinstance(base, type) and isinstance(exc, base)


def is_not_supported(exc: BaseException) -> bool:
    return _err_is(exc, "NVMLError_NotSupported", "NVML_ERROR_NOT_SUPPORTED")


def is_gpu_lost(exc: BaseException) -> bool:
    return _err_is(exc, "NVMLError_GpuIsLost", "NVML_ERROR_GPU_IS_LOST")


def is_timeout(exc: BaseException) -> bool:
    return _err_is(exc, "NVMLError_Timeout", "NVML_ERROR_TIMEOUT")


def warn_unavailable_once(reason: str) -> None:
    """Log the 'NVML unavailable' warning once per process (debug afterwards)."""
    global _warned_unavailable
    with _warned_lock:
        first = not _warned_unavailable
        _warned_unavailable = True
    msg = ("NVML unavailable: %s; GPU health triggers disabled, "
           "signal/watchdog/exception triggers remain active")
    if first:
        logger.warning(msg, reason)
    else:
        logger.debug(msg, reason)


def init() -> str | None:
    """``nvmlInit`` under the lock.  Returns None on success, else the reason string."""
    if pynvml is None:
        return "pynvml (nvidia-ml-py) is not installed"
    try:
        call("nvmlInit")
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, any NVMLError
        return f"{type(exc).__name__}: {exc}"
    return None


def shutdown() -> None:
    try:
        call("nvmlShutdown")
    except Exception as exc:
        logger.debug("nvmlShutdown failed: %s", exc)


def handle_key(handle: Any) -> Any:
    """A hashable key identifying a device handle (ctypes pointer value when possible)."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    try:
        hash(handle)
        return handle
    except TypeError:
        return id(handle)


def _to_str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def resolve_devices(devices: list[int] | None) -> list[tuple[int, Any]]:
    """Map NVML indices (or CUDA_VISIBLE_DEVICES, or all GPUs) to ``(index, handle)``.

    Must be called after a successful :func:`init`.
    """
    if devices is None:
        devices = _visible_nvml_indices()
    out: list[tuple[int, Any]] = []
    for idx in devices:
        try:
            out.append((idx, call("nvmlDeviceGetHandleByIndex", idx)))
        except Exception as exc:
            logger.warning("NVML: cannot get a handle for GPU %d: %s", idx, exc)
    return out


def _visible_nvml_indices() -> list[int]:
    count = int(call("nvmlDeviceGetCount"))
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None or not cvd.strip():
        return list(range(count))
    indices: list[int] = []
    for tok in (t.strip() for t in cvd.split(",")):
        if not tok:
            continue
        if tok.lstrip("-").isdigit():
            n = int(tok)
            if n < 0 or n >= count:
                break  # CUDA ignores everything after an invalid ordinal
            indices.append(n)
        elif tok.startswith("GPU-"):
            try:
                indices.append(int(call("nvmlDeviceGetIndex", call("nvmlDeviceGetHandleByUUID", tok))))
            except Exception as exc:
                logger.debug("NVML: cannot resolve %s from CUDA_VISIBLE_DEVICES: %s", tok, exc)
        else:
            logger.debug("NVML: ignoring CUDA_VISIBLE_DEVICES entry %r", tok)
    return indices


def field_value(handle: Any, field_id: int) -> int:
    """Read one NVML field value as an int; raises the NVML error for that field."""
    values = call("nvmlDeviceGetFieldValues", handle, [field_id])
    v = values[0]
    ret = getattr(v, "nvmlReturn", 0)
    if ret != const("NVML_SUCCESS", 0):
        err_cls = const("NVMLError")
        raise err_cls(ret) if isinstance(err_cls, type) else RuntimeError(f"NVML error {ret}")
    return int(getattr(v.value, _VALUE_FIELDS.get(int(getattr(v, "valueType", 1)), "uiVal")))


def slowdown_mask() -> int:
    mask = 0
    for name in _SLOWDOWN_BITS:
        mask |= int(const("nvmlClocksEventReason" + name, const("nvmlClocksThrottleReason" + name, 0)) or 0)
    return mask


def clock_reasons_fn() -> str | None:
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if has(name):
            return name
    return None


class NvmlBackend:
    """NVML event thread + poll thread.  Subclasses override :meth:`_emit`."""

    def __init__(self, devices: list[int] | None = None, poll_interval: float = 1.0,
                 event_timeout_ms: int = 100, event_idle_s: float = 0.1) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval!r}")
        self.poll_interval = float(poll_interval)
        self.event_timeout_ms = int(event_timeout_ms)
        self.event_idle_s = float(event_idle_s)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._event_set: Any = None
        self._event_types: list[str] = []
        self._disabled: set[tuple[int, str]] = set()
        self._lost: set[int] = set()
        self._ecc: dict[int, int] = {}
        self._remap: dict[int, tuple[bool, bool]] = {}
        self._recovery: dict[int, int] = {}
        self._thermal: dict[int, bool] = {}
        self._started = False
        self.reason: str | None = init()
        self._initialized = self.reason is None
        self.handles: list[tuple[int, Any]] = []
        if self._initialized:
            try:
                self.handles = resolve_devices(devices)
            except Exception as exc:
                self.reason = f"cannot enumerate GPUs: {type(exc).__name__}: {exc}"
            if self.reason is None and not self.handles:
                self.reason = "no GPUs visible to NVML"
            if self.reason is not None:
                shutdown()
                self._initialized = False
        if self.reason is not None:
            warn_unavailable_once(self.reason)
        self._by_key = {handle_key(h): i for i, h in self.handles}

    @property
    def available(self) -> bool:
        return self.reason is None

    # -- to override --------------------------------------------------------------
    def _emit(self, kind: str, device: int | None, code: int | None, detail: str) -> None:
        raise NotImplementedError

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        if not self.available or self._started:
            return
        self._started = True
        self._stop.clear()
        self._setup_events()
        self._baseline()
        if self._event_set is not None:
            self._threads.append(threading.Thread(target=self._event_loop,
                                                  name="cudasnap-nvml-events", daemon=True))
        self._threads.append(threading.Thread(target=self._poll_loop, name="cudasnap-nvml-poll", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(2.0, self.event_timeout_ms / 1000 + 1.0))
        self._threads = []
        if self._event_set is not None:
            try:
                call("nvmlEventSetFree", self._event_set)
            except Exception as exc:
                logger.debug("nvmlEventSetFree failed: %s", exc)
            self._event_set = None
        if self._initialized:
            shutdown()
            self._initialized = False
            self.reason = "monitor stopped"
        self._started = False

    # -- error helpers ---------------------------------------------------------------
    def _gpu_lost(self, device: int | None, where: str, exc: BaseException) -> None:
        key = -1 if device is None else device
        if key in self._lost:
            return
        self._lost.add(key)
        self._emit("gpu_lost", device, None, f"{where}: {exc}")

    def _query(self, device: int, name: str, fn: Callable[[], Any]) -> Any:
        """Run one NVML query for a device; None if disabled/unsupported/failed."""
        if (device, name) in self._disabled or device in self._lost:
            return None
        try:
            return fn()
        except Exception as exc:
            if is_gpu_lost(exc):
                self._gpu_lost(device, name, exc)
            elif is_not_supported(exc):
                self._disabled.add((device, name))
                logger.debug("NVML %s not supported on GPU %d; disabled", name, device)
            else:
                logger.debug("NVML %s failed on GPU %d: %s", name, device, exc)
            return None

    # -- events ------------------------------------------------------------------------
    def _setup_events(self) -> None:
        names = ("nvmlEventTypeXidCriticalError", "nvmlEventTypeDoubleBitEccError",
                 "nvmlEventTypeGpuUnavailableError", "nvmlEventTypeGpuRecoveryAction")
        types = [(n, const(n)) for n in names]
        types = [(n, v) for n, v in types if v is not None]
        try:
            self._event_set = call("nvmlEventSetCreate")
        except Exception as exc:
            logger.warning("NVML event set unavailable (%s); relying on polling only", exc)
            return
        registered: set[str] = set()
        for idx, h in self.handles:
            for name, value in types:
                try:
                    call("nvmlDeviceRegisterEvents", h, value, self._event_set)
                    registered.add(name)
                except Exception as exc:
                    if is_gpu_lost(exc):
                        self._gpu_lost(idx, "nvmlDeviceRegisterEvents", exc)
                    elif is_not_supported(exc):
                        logger.debug("NVML event %s not supported on GPU %d", name, idx)
                    else:
                        logger.debug("NVML event %s registration failed on GPU %d: %s", name, idx, exc)
        self._event_types = sorted(n.replace("nvmlEventType", "") for n in registered)
        if not registered:
            try:
                call("nvmlEventSetFree", self._event_set)
            except Exception:
                pass
            self._event_set = None

    def _device_of(self, handle: Any) -> int | None:
        idx = self._by_key.get(handle_key(handle))
        if idx is not None:
            return idx
        if len(self.handles) == 1:
            return self.handles[0][0]
        try:
            return int(call("nvmlDeviceGetIndex", handle))
        except Exception:
            return None

    def _event_loop(self) -> None:
        errors = 0
        while not self._stop.is_set():
            try:
                data = call("nvmlEventSetWait_v2", self._event_set, self.event_timeout_ms)
            except Exception as exc:
                if is_timeout(exc):
                    errors = 0
                    self._stop.wait(self.event_idle_s)  # events queue in the set meanwhile
                    continue
                if is_gpu_lost(exc):
                    self._gpu_lost(None, "nvmlEventSetWait", exc)
                    return
                errors += 1
                logger.warning("NVML event wait failed (%d): %s", errors, exc)
                if errors >= 10:
                    logger.error("NVML event thread giving up after %d errors; polling continues", errors)
                    return
                self._stop.wait(min(5.0, 0.1 * 2 ** errors))
                continue
            errors = 0
            self._handle_event(data)

    def _handle_event(self, data: Any) -> None:
        etype = int(getattr(data, "eventType", 0))
        edata = int(getattr(data, "eventData", 0))
        device = self._device_of(getattr(data, "device", None))
        if etype & int(const("nvmlEventTypeXidCriticalError", 0) or 0):
            self._emit("xid", device, edata, f"Xid {edata} reported by NVML")
        elif etype & int(const("nvmlEventTypeDoubleBitEccError", 0) or 0):
            self._emit("ecc_dbe", device, None, "double-bit ECC error event")
        elif etype & int(const("nvmlEventTypeGpuUnavailableError", 0) or 0):
            self._gpu_lost(device, "GpuUnavailableError event", RuntimeError(f"eventData={edata}"))
        elif etype & int(const("nvmlEventTypeGpuRecoveryAction", 0) or 0):
            self._emit("recovery_action", device, edata, f"GPU recovery action {edata} requested (event)")
        else:
            logger.debug("NVML: ignoring event type 0x%x data %d", etype, edata)

    # -- polling -------------------------------------------------------------------------
    def _read_ecc(self, h: Any) -> int:
        return int(call("nvmlDeviceGetTotalEccErrors", h, const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                        const("NVML_VOLATILE_ECC", 0)))

    def _read_remap(self, h: Any) -> tuple[bool, bool]:
        _corr, _unc, pending, failure = call("nvmlDeviceGetRemappedRows", h)
        return bool(pending), bool(failure)

    def _baseline(self) -> None:
        """Record current counters so that only changes after start() trigger."""
        fid = const("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
        for idx, h in self.handles:
            ecc = self._query(idx, "ecc", lambda h=h: self._read_ecc(h))
            if ecc is not None:
                self._ecc[idx] = ecc
            remap = self._query(idx, "remap", lambda h=h: self._read_remap(h))
            if remap is not None:
                self._remap[idx] = remap
                if remap[1]:
                    logger.warning("GPU %d already has a row-remapping failure at start", idx)
                elif remap[0]:
                    logger.warning("GPU %d already has a row remap pending at start (reset needed)", idx)
            if fid is None:
                self._disabled.add((idx, "recovery"))
            else:
                rec = self._query(idx, "recovery", lambda h=h: field_value(h, fid))
                if rec is not None:
                    self._recovery[idx] = rec
                    if rec:
                        logger.warning("GPU %d already requests recovery action %d at start", idx, rec)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.poll_once()
            except Exception:
                logger.exception("NVML poll iteration failed")

    def poll_once(self) -> None:
        """One polling pass over all devices (also callable directly, e.g. in tests)."""
        fid = const("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
        reasons_fn = clock_reasons_fn()
        mask = slowdown_mask()
        for idx, h in self.handles:
            if self._stop.is_set():
                return
            ecc = self._query(idx, "ecc", lambda h=h: self._read_ecc(h))
            if ecc is not None:
                prev = self._ecc.get(idx, ecc)
                self._ecc[idx] = ecc
                if ecc > prev:
                    self._emit("ecc_uncorrected", idx, ecc - prev,
                               f"volatile uncorrected ECC errors {prev} -> {ecc}")
            remap = self._query(idx, "remap", lambda h=h: self._read_remap(h))
            if remap is not None:
                pend0, fail0 = self._remap.get(idx, (False, False))
                self._remap[idx] = remap
                if remap[1] and not fail0:
                    self._emit("remap_failure", idx, None, "row remapping failure occurred")
                elif remap[0] and not pend0:
                    self._emit("remap_pending", idx, None, "row remap pending; GPU reset required")
            if fid is not None:
                rec = self._query(idx, "recovery", lambda h=h: field_value(h, fid))
                if rec is not None:
                    prev_rec = self._recovery.get(idx, 0)
                    self._recovery[idx] = rec
                    if rec and rec != prev_rec:
                        self._emit("recovery_action", idx, rec, f"GPU recovery action {rec} requested")
            if reasons_fn is not None and mask:
                bits = self._query(idx, "clocks", lambda h=h: int(call(reasons_fn, h)))
                if bits is not None:
                    hot = bool(bits & mask)
                    if hot and not self._thermal.get(idx, False):
                        self._emit("thermal", idx, bits & mask, f"clock slowdown reasons 0x{bits & mask:x}")
                    self._thermal[idx] = hot


def read_gpu_status(devices: list[int] | None = None) -> list[dict[str, Any]]:
    """One dict per GPU for ``cudasnap health``; raises RuntimeError if NVML is unavailable."""
    reason = init()
    if reason is not None:
        raise RuntimeError(f"NVML unavailable: {reason}")
    try:
        idx_list = list(range(int(call("nvmlDeviceGetCount")))) if devices is None else devices
        fid = const("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
        out: list[dict[str, Any]] = []
        for idx in idx_list:
            row: dict[str, Any] = {"index": idx, "name": None, "temperature": None, "ecc_uncorrected": None,
                                   "remapped_rows": None, "recovery_action": None, "error": None}
            try:
                h = call("nvmlDeviceGetHandleByIndex", idx)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                out.append(row)
                continue
            queries: list[tuple[str, Callable[[], Any]]] = [
                ("name", lambda: _to_str(call("nvmlDeviceGetName", h))),
                ("temperature", lambda: int(call("nvmlDeviceGetTemperature", h,
                                                 const("NVML_TEMPERATURE_GPU", 0)))),
                ("ecc_uncorrected", lambda: int(call("nvmlDeviceGetTotalEccErrors", h,
                                                     const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                                     const("NVML_VOLATILE_ECC", 0)))),
                ("remapped_rows", lambda: dict(zip(("correctable", "uncorrectable", "pending",
                                                    "failure"),
                                                   (int(x) for x in call("nvmlDeviceGetRemappedRows", h))))),
            ]
            if fid is not None:
                queries.append(("recovery_action", lambda: field_value(h, fid)))
            for key, fn in queries:
                try:
                    row[key] = fn()
                except Exception as exc:
                    if is_gpu_lost(exc):
                        row["error"] = "GPU is lost"
                        break
                    if not is_not_supported(exc):
                        logger.debug("NVML %s failed on GPU %d: %s", key, idx, exc)
            out.append(row)
        return out
    finally:
        shutdown()
