"""The NVML session: every NVML call cudasnap makes, under one lock.

Everything that touches NVML goes through :func:`call`, which holds the single
module-level :data:`LOCK` for the duration of the NVML call.  The pynvml module
object is looked up at call time via the module attribute :data:`pynvml` (None
without pynvml), never kept elsewhere.
NVML is used from Python only (the C++ engine never links it).

:class:`NvmlSession` is one ``nvmlInit`` .. ``nvmlShutdown`` with the device
handles resolved; :data:`QUERIES` is the one table of per-device reads shared by
the health watcher (:mod:`cudasnap.triggers.nvml_source`) and
:func:`read_gpu_status` (``cudasnap health``).  "NVML unavailable" is logged
once per job (:func:`warn_unavailable_once`): a WARNING when CUDA devices are in
use, INFO on a CPU-only machine, DEBUG in restarts and ranks other than 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

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


def _cuda_in_use() -> bool:
    """Whether this process uses (or can use) CUDA devices: CUDA initialised by torch, or an
    NVIDIA driver's device node present. Neither on a CPU-only machine."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return True
    except Exception:  # a torch without CUDA support, or half-imported
        pass
    return os.path.exists("/dev/nvidiactl")


def warn_unavailable_once(reason: str, first_of_job: bool = True) -> None:
    """Log 'NVML unavailable' once per job: in the first process of a job (rank 0 of
    the first attempt), once per process; everywhere else at DEBUG.

    A WARNING when CUDA devices are in use (GPU faults then go unseen); at INFO on a
    CPU-only machine, where there is nothing for NVML to watch.
    """
    global _warned_unavailable
    with _warned_lock:
        first = not _warned_unavailable
        _warned_unavailable = True
    msg = ("NVML unavailable: %s; GPU health triggers disabled, "
           "signal/watchdog/exception triggers remain active")
    if not first or not first_of_job:
        level = logging.DEBUG
    else:
        level = logging.WARNING if _cuda_in_use() else logging.INFO
    logger.log(level, msg, reason)


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


class RemappedRows(NamedTuple):
    correctable: int
    uncorrectable: int
    pending: int
    failure: int


def _recovery_action(h: Any) -> int:
    fid = const("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
    if fid is None:
        err = const("NVMLError_NotSupported")
        raise err() if isinstance(err, type) else RuntimeError("recovery-action field not supported")
    return field_value(h, fid)


def _clock_reasons(h: Any) -> int:
    fn = clock_reasons_fn()
    if fn is None:
        err = const("NVMLError_NotSupported")
        raise err() if isinstance(err, type) else RuntimeError("clock event reasons not supported")
    return int(call(fn, h))


#: The per-device reads, by name: each takes a device handle and raises the NVML
#: error of that query (NotSupported, GpuIsLost, ...).
QUERIES: dict[str, Callable[[Any], Any]] = {
    "name": lambda h: _to_str(call("nvmlDeviceGetName", h)),
    "temperature": lambda h: int(call("nvmlDeviceGetTemperature", h, const("NVML_TEMPERATURE_GPU", 0))),
    "ecc": lambda h: int(call("nvmlDeviceGetTotalEccErrors", h, const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                              const("NVML_VOLATILE_ECC", 0))),
    "remap": lambda h: RemappedRows(*(int(x) for x in call("nvmlDeviceGetRemappedRows", h))),
    "recovery": _recovery_action,
    "clocks": _clock_reasons,
}


class NvmlSession:
    """``nvmlInit`` with the monitored devices' handles, until :meth:`close`.

    ``devices`` are NVML indices; None means the GPUs in ``CUDA_VISIBLE_DEVICES``
    (all GPUs when unset). When NVML cannot be used, :attr:`reason` says why and
    "NVML unavailable" is logged once per job (:func:`warn_unavailable_once`).
    """

    def __init__(self, devices: list[int] | None = None, first_of_job: bool = True) -> None:
        """``first_of_job``: False in a restarted attempt and in ranks other than 0
        (``cudasnap.config.Settings.first_of_job``): "NVML unavailable" at DEBUG there."""
        self.handles: list[tuple[int, Any]] = []
        self.reason: str | None = init()
        self._open = self.reason is None
        if self._open:
            try:
                self.handles = resolve_devices(devices)
            except Exception as exc:
                self.reason = f"cannot enumerate GPUs: {type(exc).__name__}: {exc}"
            if self.reason is None and not self.handles:
                self.reason = "no GPUs visible to NVML"
            if self.reason is not None:
                self.close()
        if self.reason is not None:
            warn_unavailable_once(self.reason, first_of_job)
        self._by_key = {handle_key(h): i for i, h in self.handles}

    @property
    def available(self) -> bool:
        return self.reason is None

    def read(self, handle: Any, name: str) -> Any:
        """One query from :data:`QUERIES`; raises the NVML error."""
        return QUERIES[name](handle)

    def device_of(self, handle: Any) -> int | None:
        """The NVML index of an event's device handle."""
        idx = self._by_key.get(handle_key(handle))
        if idx is not None:
            return idx
        if len(self.handles) == 1:
            return self.handles[0][0]
        try:
            return int(call("nvmlDeviceGetIndex", handle))
        except Exception:
            return None

    def close(self) -> None:
        if self._open:
            shutdown()
            self._open = False
            if self.reason is None:
                self.reason = "monitor stopped"


#: ``read_gpu_status`` columns -> (query name, conversion)
_STATUS_COLUMNS: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("name", "name", lambda v: v),
    ("temperature", "temperature", lambda v: v),
    ("ecc_uncorrected", "ecc", lambda v: v),
    ("remapped_rows", "remap", lambda v: dict(v._asdict())),
    ("recovery_action", "recovery", lambda v: v),
)


def read_gpu_status(devices: list[int] | None = None) -> list[dict[str, Any]]:
    """One dict per GPU (all GPUs unless ``devices``) for ``cudasnap health``: index, name,
    temperature, ecc_uncorrected, remapped_rows, recovery_action, error.
    Raises ``RuntimeError("NVML unavailable: ...")``."""
    reason = init()
    if reason is not None:
        raise RuntimeError(f"NVML unavailable: {reason}")
    try:
        idx_list = list(range(int(call("nvmlDeviceGetCount")))) if devices is None else devices
        out: list[dict[str, Any]] = []
        for idx in idx_list:
            row: dict[str, Any] = {"index": idx, **{col: None for col, _, _ in _STATUS_COLUMNS}, "error": None}
            out.append(row)
            try:
                h = call("nvmlDeviceGetHandleByIndex", idx)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                continue
            for col, query, conv in _STATUS_COLUMNS:
                try:
                    row[col] = conv(QUERIES[query](h))
                except Exception as exc:
                    if is_gpu_lost(exc):
                        row["error"] = "GPU is lost"
                        break
                    if not is_not_supported(exc):
                        logger.debug("NVML %s failed on GPU %d: %s", query, idx, exc)
        return out
    finally:
        shutdown()
