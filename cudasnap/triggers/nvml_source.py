"""NVML health triggers: an event thread and a poll thread over one :class:`NvmlSession`.

:class:`NvmlWatcher` waits for NVML events (Xid, double-bit ECC, GPU
unavailable, recovery action) and polls the :data:`~cudasnap.triggers.nvml.QUERIES`
(uncorrected ECC, row remapping, recovery action, clock slowdown), reporting
each change to a sink ``(kind, device, code, detail)``; it knows nothing of
triggers. :class:`NvmlSource` composes a session, a watcher and a sink that
builds :class:`Trigger` objects for a callback.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .kinds import Trigger, TriggerCallback
from .nvml import NvmlSession, call, clock_reasons_fn, const, is_gpu_lost, is_not_supported, is_timeout, slowdown_mask

logger = logging.getLogger("cudasnap.health")

#: ``sink(kind, device, code, detail)`` receives each detection.
Sink = Callable[[str, "int | None", "int | None", str], None]


class NvmlWatcher:
    """NVML event thread + poll thread for the devices of ``session``; detections go to ``sink``."""

    def __init__(self, session: NvmlSession, sink: Sink, poll_interval: float = 1.0,
                 event_timeout_ms: int = 100, event_idle_s: float = 0.1) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval!r}")
        self.session = session
        self._sink = sink
        self.poll_interval = float(poll_interval)
        self.event_timeout_ms = int(event_timeout_ms)
        self.event_idle_s = float(event_idle_s)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._event_set: Any = None
        self.event_types: list[str] = []
        self._disabled: set[tuple[int, str]] = set()
        self._lost: set[int] = set()
        self._ecc: dict[int, int] = {}
        self._remap: dict[int, tuple[bool, bool]] = {}
        self._recovery: dict[int, int] = {}
        self._thermal: dict[int, bool] = {}
        self._started = False

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        if not self.session.available or self._started:
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
        self.session.close()
        self._started = False

    # -- error helpers ---------------------------------------------------------------
    def _gpu_lost(self, device: int | None, where: str, exc: BaseException) -> None:
        key = -1 if device is None else device
        if key in self._lost:
            return
        self._lost.add(key)
        self._sink("gpu_lost", device, None, f"{where}: {exc}")

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
        for idx, h in self.session.handles:
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
        self.event_types = sorted(n.replace("nvmlEventType", "") for n in registered)
        if not registered:
            try:
                call("nvmlEventSetFree", self._event_set)
            except Exception:
                pass
            self._event_set = None

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
        device = self.session.device_of(getattr(data, "device", None))
        if etype & int(const("nvmlEventTypeXidCriticalError", 0) or 0):
            self._sink("xid", device, edata, f"Xid {edata} reported by NVML")
        elif etype & int(const("nvmlEventTypeDoubleBitEccError", 0) or 0):
            self._sink("ecc_dbe", device, None, "double-bit ECC error event")
        elif etype & int(const("nvmlEventTypeGpuUnavailableError", 0) or 0):
            self._gpu_lost(device, "GpuUnavailableError event", RuntimeError(f"eventData={edata}"))
        elif etype & int(const("nvmlEventTypeGpuRecoveryAction", 0) or 0):
            self._sink("recovery_action", device, edata, f"GPU recovery action {edata} requested (event)")
        else:
            logger.debug("NVML: ignoring event type 0x%x data %d", etype, edata)

    # -- polling -------------------------------------------------------------------------
    def _read(self, idx: int, h: Any, name: str) -> Any:
        return self._query(idx, name, lambda: self.session.read(h, name))

    def _read_remap(self, idx: int, h: Any) -> tuple[bool, bool] | None:
        rows = self._read(idx, h, "remap")
        return None if rows is None else (bool(rows.pending), bool(rows.failure))

    def _baseline(self) -> None:
        """Record current counters so that only changes after start() trigger."""
        for idx, h in self.session.handles:
            ecc = self._read(idx, h, "ecc")
            if ecc is not None:
                self._ecc[idx] = ecc
            remap = self._read_remap(idx, h)
            if remap is not None:
                self._remap[idx] = remap
                if remap[1]:
                    logger.warning("GPU %d already has a row-remapping failure at start", idx)
                elif remap[0]:
                    logger.warning("GPU %d already has a row remap pending at start (reset needed)", idx)
            rec = self._read(idx, h, "recovery")
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
        """One polling pass over all devices (the poll loop's body; also callable on its own)."""
        mask = slowdown_mask() if clock_reasons_fn() is not None else 0
        for idx, h in self.session.handles:
            if self._stop.is_set():
                return
            ecc = self._read(idx, h, "ecc")
            if ecc is not None:
                prev = self._ecc.get(idx, ecc)
                self._ecc[idx] = ecc
                if ecc > prev:
                    self._sink("ecc_uncorrected", idx, ecc - prev,
                               f"volatile uncorrected ECC errors {prev} -> {ecc}")
            remap = self._read_remap(idx, h)
            if remap is not None:
                pend0, fail0 = self._remap.get(idx, (False, False))
                self._remap[idx] = remap
                if remap[1] and not fail0:
                    self._sink("remap_failure", idx, None, "row remapping failure occurred")
                elif remap[0] and not pend0:
                    self._sink("remap_pending", idx, None, "row remap pending; GPU reset required")
            rec = self._read(idx, h, "recovery")
            if rec is not None:
                prev_rec = self._recovery.get(idx, 0)
                self._recovery[idx] = rec
                if rec and rec != prev_rec:
                    self._sink("recovery_action", idx, rec, f"GPU recovery action {rec} requested")
            if mask:
                bits = self._read(idx, h, "clocks")
                if bits is not None:
                    hot = bool(bits & mask)
                    if hot and not self._thermal.get(idx, False):
                        self._sink("thermal", idx, bits & mask, f"clock slowdown reasons 0x{bits & mask:x}")
                    self._thermal[idx] = hot


class NvmlSource:
    """Real NVML health source: :class:`NvmlWatcher` detections as :class:`Trigger` objects."""

    def __init__(self, on_trigger: TriggerCallback, devices: list[int] | None = None,
                 poll_interval: float = 1.0, event_timeout_ms: int = 100,
                 first_of_job: bool = True) -> None:
        self._on_trigger = on_trigger
        self._step: int | None = None
        self.session = NvmlSession(devices, first_of_job)
        self.watcher = NvmlWatcher(self.session, self._emit, poll_interval=poll_interval,
                                   event_timeout_ms=event_timeout_ms)

    @property
    def available(self) -> bool:
        return self.session.available

    @property
    def reason(self) -> str | None:
        return self.session.reason

    @property
    def handles(self) -> list[tuple[int, Any]]:
        return self.session.handles

    def start(self) -> None:
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()

    def poll_once(self) -> None:
        self.watcher.poll_once()

    def notify_step(self, step: int) -> None:
        self._step = step  # O(1); read by the watcher threads

    def should_hang(self, step: int) -> bool:
        return False

    def _emit(self, kind: str, device: int | None, code: int | None, detail: str) -> None:
        trig = Trigger(kind=kind, device=device, code=code, detail=detail, step=self._step)
        logger.debug("NVML trigger: %s", trig.describe())
        try:
            self._on_trigger(trig)
        except Exception:
            logger.exception("trigger callback failed for %s", trig.describe())

    def describe(self) -> str:
        if not self.available:
            return f"NVML unavailable: {self.reason}"
        events = ",".join(self.watcher.event_types) if self.watcher.event_types else "none registered yet"
        return (f"NVML health monitor: GPUs {[i for i, _ in self.handles]}, "
                f"poll every {self.watcher.poll_interval:g}s, events: {events}")
