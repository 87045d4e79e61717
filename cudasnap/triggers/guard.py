"""Wires the health monitor, signal pipe, watchdog and excepthook to a flush target.

Every trigger goes through one :class:`~cudasnap.triggers.dispatch.Dispatcher`,
whose :class:`~cudasnap.triggers.policy.Policy` decides: log, flush, or flush
and exit with a code that names the cause (see cudasnap.triggers.policy).

The guard knows its owner only through :class:`FlushTarget` (``flush(wait,
timeout)``); a Snapshotter is one, and the guard never imports it.

Environment (set by ``cudasnap run``, or by hand; parsed by cudasnap.config.Settings):
  CUDASNAP_HEALTH=1        start the guard in every Snapshotter
  CUDASNAP_WATCHDOG_S=T    hang watchdog: no boundary for T seconds -> trigger "hang"
  CUDASNAP_POLL_S=P        NVML poll interval (default 1 s)
  CUDASNAP_INJECT=SPEC     scripted faults instead of NVML (e.g. "xid=79@step=40")
  CUDASNAP_POLICY=SPEC     policy overrides (e.g. "thermal=flush,sigusr1=flush_exit")
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ..config import POLL_S
from .dispatch import Dispatcher, HistoryEntry
from .hooks import ExceptHooks, install_excepthook
from .kinds import Trigger, TriggerKind
from .monitor import HealthMonitor
from .policy import Policy
from .signals import SignalHandlers, install_signal_handlers
from .watchdog import Watchdog

log = logging.getLogger("cudasnap.guard")


class FlushTarget(Protocol):
    """What the guard needs from its owner: write the newest snapshot to disk now."""

    def flush(self, wait: bool = ..., timeout: float | None = ...) -> "Path | str | None": ...


# Triggers after which the GPU may never finish a copy: flush what is COMPLETE now.
_NO_WAIT = {k.kind for k in TriggerKind if k.no_wait}


# Guard.stop() waits this long for a triggered flush still in progress.
_STOP_WAIT_S = 120.0


class Guard:
    """Health monitor + signals + watchdog + excepthook for one :class:`FlushTarget`."""

    def __init__(self, target: FlushTarget, policy: Policy | None = None, inject: str | None = None,
                 watchdog_s: float | None = None, poll_s: float | None = None,
                 exit_fn: Any = os._exit, signals: bool = True, first_of_job: bool = True) -> None:
        self._target = target
        self.last_step: int | None = None
        # The values are the caller's (the Snapshotter resolves them from its keywords and
        # the environment: cudasnap.core.options.HealthOptions); None: the default.
        self.dispatcher = Dispatcher(self._flush, policy=policy or Policy(),
                                     exit_fn=exit_fn, step_fn=lambda: self.last_step)
        self.monitor = HealthMonitor(self._on_health,
                                     poll_interval=POLL_S if poll_s is None else poll_s,
                                     inject=inject, first_of_job=first_of_job)
        self.watchdog = Watchdog(watchdog_s, self.dispatcher.on_hang) if watchdog_s else None
        self._want_signals = signals
        self._signals: SignalHandlers | None = None
        self._hooks: ExceptHooks | None = None
        self._started = False

    def _on_health(self, trigger: Trigger) -> None:
        self.dispatcher.handle(trigger)

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.monitor.start()
        if self.watchdog is not None:
            self.watchdog.start()
        if self._want_signals:
            self._signals = install_signal_handlers(self.dispatcher.handle, exit_fn=self.dispatcher.exit_fn)
        self._hooks = install_excepthook(self.dispatcher.handle)
        # Without NVML the warning was logged once per process already: don't repeat it here.
        health = self.monitor.describe() if self.monitor.available else "GPU health monitor off"
        log.info("guard on: %s; watchdog %s; policy %s", health,
                 f"{self.watchdog.timeout_s:.1f} s" if self.watchdog else "off",
                 self.dispatcher.policy.describe())

    def on_boundary(self, step: int) -> None:
        self.last_step = step
        if self.watchdog is not None:
            self.watchdog.kick(step)
        self.monitor.notify_step(step)  # may raise InjectedFault for "exception@step=N"

    def should_hang(self, step: int) -> bool:
        """True when an injected ``hang@step=N`` asks the harness to stall here."""
        return self.monitor.should_hang(step)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Suspends hang detection in the block (a flush or a restore is not a hang)."""
        if self.watchdog is None:
            yield
        else:
            with self.watchdog.paused():
                yield

    def on_exception(self, exc: BaseException | None) -> None:
        self.dispatcher.handle(Trigger(kind="exception", detail=f"{type(exc).__name__}: {exc}"))

    def trigger(self, kind: str, detail: str = "") -> str | None:
        """Feeds a trigger through the policy (e.g. from a distributed peer monitor)."""
        return self.dispatcher.handle(Trigger(kind=kind, detail=detail))

    def _flush(self, trigger: Trigger) -> str | None:
        wait = trigger.kind not in _NO_WAIT
        path = self._target.flush(wait=wait, timeout=5.0 if wait else 0.0)
        return str(path) if path is not None else None

    def history(self) -> list[HistoryEntry]:
        return list(self.dispatcher.history)

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self.monitor.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._signals is not None:
            self._signals.uninstall()
            self._signals.join(_STOP_WAIT_S)  # a signal already received is still handled
        if self._hooks is not None:
            self._hooks.uninstall()
        # A flush a trigger started (SIGUSR1, a health event) must finish before the
        # Snapshotter closes its arena under it.
        if not self.dispatcher.wait_idle(_STOP_WAIT_S):
            log.warning("a triggered flush is still running after %.0f s; closing anyway",
                        _STOP_WAIT_S)
