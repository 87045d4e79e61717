"""GPU health monitor: NVML (default) or scripted injection, delivering Triggers to a callback."""
from __future__ import annotations

import logging
import threading
from typing import Any

from .inject import InjectedSource
from .kinds import TriggerCallback
from .nvml_source import NvmlSource

logger = logging.getLogger("cudasnap.health")


class HealthMonitor:
    """GPU health monitor: NVML (default) or scripted injection (``inject`` / ``CUDASNAP_INJECT``)."""

    def __init__(self, on_trigger: TriggerCallback, devices: list[int] | None = None,
                 poll_interval: float = 1.0, inject: str | None = None,
                 first_of_job: bool = True) -> None:
        """``inject``: scripted faults (None or empty: NVML); ``first_of_job``: see
        cudasnap.triggers.nvml.NvmlSession. Both the caller's (the Snapshotter's options)."""
        self._on_trigger = on_trigger
        spec = inject
        self.source: NvmlSource | InjectedSource
        if spec is not None and spec.strip():
            self.source = InjectedSource(spec, on_trigger)
        else:
            self.source = NvmlSource(on_trigger, devices=devices, poll_interval=poll_interval,
                                     first_of_job=first_of_job)
        self._started = False
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return bool(self.source.available)

    @property
    def injected(self) -> bool:
        return isinstance(self.source, InjectedSource)

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self.source.start()
        if self.available:  # an unavailable NVML was already reported (once per job)
            logger.info("%s", self.describe())

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
        self.source.stop()

    def notify_step(self, step: int) -> None:
        self.source.notify_step(step)

    def should_hang(self, step: int) -> bool:
        return self.source.should_hang(step)

    def describe(self) -> str:
        return self.source.describe()

    def __enter__(self) -> "HealthMonitor":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
