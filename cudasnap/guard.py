"""Wires the health monitor, signal handlers, watchdog and excepthook to a Snapshotter.

Every trigger goes through one :class:`~cudasnap.triggers.Dispatcher`, whose
:class:`~cudasnap.triggers.Policy` decides: log, flush, or flush and exit
with a code that names the cause (see cudasnap.triggers for the exit codes).

Environment (set by ``cudasnap run``, or by hand):
  CUDASNAP_HEALTH=1        start the guard in every Snapshotter
  CUDASNAP_WATCHDOG_S=T    hang watchdog: no boundary for T seconds -> trigger "hang"
  CUDASNAP_POLL_S=P        NVML poll interval (default 1 s)
  CUDASNAP_INJECT=SPEC     scripted faults instead of NVML (e.g. "xid=79@step=40")
  CUDASNAP_POLICY=SPEC     policy overrides (e.g. "thermal=flush,sigusr1=flush_exit")
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .health import HealthMonitor, Trigger
from .triggers import EXIT_PREEMPTED, Dispatcher, Policy, Watchdog, install_excepthook, install_signal_handlers

if TYPE_CHECKING:
    from .snapshotter import Snapshotter

log = logging.getLogger("cudasnap.guard")

# Triggers after which the GPU may never finish a copy: flush what is COMPLETE now.
_NO_WAIT = {"xid", "ecc_dbe", "ecc_uncorrected", "gpu_lost", "remap_failure", "recovery_action"}


def _env_float(name: str) -> float | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not a number") from None


# Guard.stop() waits this long for a triggered flush still in progress.
_STOP_WAIT_S = 120.0

_KINDS = {signal.SIGTERM: "sigterm", signal.SIGUSR1: "sigusr1"}


class SignalThread:
    """SIGTERM/SIGUSR1 through a C-level self-pipe to a dedicated thread.

    Unlike a Python signal handler, this flushes even while the main thread is
    blocked inside a collective or a CUDA call. After SIGTERM whose previous
    disposition was the default, the process exits (code 78) once the flush is
    done, as the default action would have killed it.
    """

    def __init__(self, callback: Callable[[Trigger], Any], exit_fn: Callable[[int], Any],
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        from ._native import native

        self._callback = callback
        self._exit = exit_fn
        self._default = {int(s): signal.getsignal(s) in (signal.SIG_DFL, None) for s in signals}
        self._fd = native().install_signal_pipe([int(s) for s in signals])
        self._thread = threading.Thread(target=self._run, name="cudasnap-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                b = os.read(self._fd, 1)
            except OSError:
                return
            if not b:
                os.close(self._fd)
                return
            signum = b[0]
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = str(signum)
            try:
                self._callback(Trigger(kind=_KINDS.get(signal.Signals(signum), "manual"),
                                       code=signum, detail=f"received {name}"))
            except Exception:  # noqa: BLE001 - a signal must never kill this thread silently
                log.exception("handling %s failed", name)
            if signum == signal.SIGTERM and self._default.get(signum):
                log.warning("SIGTERM: flush done, exiting with code %d", EXIT_PREEMPTED)
                self._exit(EXIT_PREEMPTED)

    def uninstall(self) -> None:
        from ._native import native

        native().uninstall_signal_pipe()

    def join(self, timeout: float | None = None) -> None:
        """After :meth:`uninstall`: lets the thread handle signals already in the pipe."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class Guard:
    """Health monitor + signals + watchdog + excepthook for one Snapshotter."""

    def __init__(self, snap: "Snapshotter", policy: Policy | None = None, inject: str | None = None,
                 watchdog_s: float | None = None, poll_s: float | None = None,
                 exit_fn: Any = os._exit, signals: bool = True) -> None:
        self.snap = snap
        self.last_step: int | None = None
        self.dispatcher = Dispatcher(self._flush, policy=policy or Policy.from_env(),
                                     exit_fn=exit_fn, step_fn=lambda: self.last_step)
        poll = poll_s if poll_s is not None else (_env_float("CUDASNAP_POLL_S") or 1.0)
        self.monitor = HealthMonitor(self._on_health, poll_interval=poll, inject=inject)
        wd = watchdog_s if watchdog_s is not None else _env_float("CUDASNAP_WATCHDOG_S")
        self.watchdog = Watchdog(wd, self.dispatcher.on_hang) if wd else None
        self._want_signals = signals
        self._signals: Any = None
        self._hooks: Any = None
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
            try:
                self._signals = SignalThread(self.dispatcher.handle, self.dispatcher.exit_fn)
            except Exception as e:  # noqa: BLE001 - fall back to Python handlers
                log.warning("signal pipe unavailable (%s); using Python signal handlers", e)
                if threading.current_thread() is threading.main_thread():
                    self._signals = install_signal_handlers(self.dispatcher.handle)
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

    def on_exception(self, exc: BaseException | None) -> None:
        self.dispatcher.handle(Trigger(kind="exception", detail=f"{type(exc).__name__}: {exc}"))

    def trigger(self, kind: str, detail: str = "") -> str | None:
        """Feeds a trigger through the policy (e.g. from a distributed peer monitor)."""
        return self.dispatcher.handle(Trigger(kind=kind, detail=detail))

    def _flush(self, trigger: Trigger) -> str | None:
        wait = trigger.kind not in _NO_WAIT
        path = self.snap.flush(wait=wait, timeout=5.0 if wait else 0.0)
        return str(path) if path is not None else None

    def history(self) -> list[Any]:
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
            join = getattr(self._signals, "join", None)
            if join is not None:
                join(_STOP_WAIT_S)  # a signal already received is still handled
        if self._hooks is not None:
            self._hooks.uninstall()
        # A flush a trigger started (SIGUSR1, a health event) must finish before the
        # Snapshotter closes its arena under it.
        if not self.dispatcher.wait_idle(_STOP_WAIT_S):
            log.warning("a triggered flush is still running after %.0f s; closing anyway",
                        _STOP_WAIT_S)
