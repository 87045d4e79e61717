"""Signal triggers: SIGTERM/SIGUSR1 through the C-level self-pipe to one thread.

This is cudasnap's only signal path. The async-signal-safe handler in
``csrc/signals.cpp`` writes the signal number into a pipe; one reader thread
(``cudasnap-signals``) turns each byte into a :class:`Trigger` and calls every
registered callback. Unlike a Python signal handler this flushes even while the
main thread is blocked inside a collective or a CUDA call, and it can be
installed from any thread.

A previous handler is chained by the C handler itself (a Python handler then
runs on the main thread as usual, concurrently with the callback). When the
previous SIGTERM disposition was the default (die), the reader thread exits the
process with ``sigterm_exit_code`` (78) once the callbacks returned, as the
default action would have killed it.

The pipe and its thread are process-wide: each :func:`install_signal_handlers`
registers one callback; the pipe is uninstalled when the last one is removed.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from .dispatch import flush_std_streams
from .kinds import Trigger
from .policy import EXIT_PREEMPTED

logger = logging.getLogger("cudasnap.triggers")

_KINDS = {int(signal.SIGTERM): "sigterm", int(signal.SIGUSR1): "sigusr1"}
DEFAULT_SIGNALS: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGUSR1))


class SignalHandlers:
    """One registration on the signal pipe; :meth:`uninstall` removes it."""

    def __init__(self, callback: Callable[[Trigger], Any], exit_fn: Callable[[int], Any],
                 sigterm_exit_code: int, signals: tuple[int, ...], default: dict[int, bool]) -> None:
        self.callback = callback
        self.exit_fn = exit_fn
        self.sigterm_exit_code = sigterm_exit_code
        self.signals = signals
        self.default = default  # signum -> previous disposition was SIG_DFL

    @property
    def installed(self) -> list[int]:
        return list(self.signals) if _ROUTER.has(self) else []

    def uninstall(self) -> None:
        _ROUTER.remove(self)

    def join(self, timeout: float | None = None) -> None:
        """After :meth:`uninstall`: waits until signals already in the pipe were handled."""
        _ROUTER.join(timeout)


class _Router:
    """The pipe's reader thread and the registered callbacks (process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regs: list[SignalHandlers] = []
        self._thread: threading.Thread | None = None
        self._fd = -1

    def has(self, reg: SignalHandlers) -> bool:
        with self._lock:
            return reg in self._regs

    def add(self, reg: SignalHandlers) -> None:
        from .._native import native  # the extension loads only when signals are wanted

        with self._lock:
            fd = native().install_signal_pipe(list(reg.signals))
            self._regs.append(reg)
            if self._thread is None or fd != self._fd:  # first, or a new pipe after an uninstall
                self._fd = fd
                self._thread = threading.Thread(target=self._run, args=(fd,), name="cudasnap-signals",
                                                daemon=True)
                self._thread.start()

    def remove(self, reg: SignalHandlers) -> None:
        with self._lock:
            if reg not in self._regs:
                return
            self._regs.remove(reg)
            if self._regs:
                return
        from .._native import native

        native().uninstall_signal_pipe()  # EOF ends the reader once the pipe is drained

    def join(self, timeout: float | None = None) -> None:
        with self._lock:
            t = self._thread if not self._regs else None
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def _run(self, fd: int) -> None:
        while True:
            try:
                b = os.read(fd, 1)
            except OSError:
                return
            if not b:  # uninstalled: closing and forgetting under the lock lets add() tell pipes apart
                with self._lock:
                    os.close(fd)
                    if self._thread is threading.current_thread():
                        self._thread = None
                return
            self._deliver(b[0])

    def _deliver(self, signum: int) -> None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        with self._lock:
            regs = [r for r in reversed(self._regs) if signum in r.signals]  # newest first
        trig = Trigger(kind=_KINDS.get(signum, "manual"), code=signum, detail=f"received {name}")
        for reg in regs:
            try:
                reg.callback(trig)
            except Exception:  # noqa: BLE001 - a signal must never kill this thread silently
                logger.exception("signal callback failed for %s", name)
        for reg in regs:
            if signum == signal.SIGTERM and reg.default.get(signum):
                logger.warning("%s: flush done, terminating with exit code %d", name, reg.sigterm_exit_code)
                flush_std_streams()
                reg.exit_fn(reg.sigterm_exit_code)
                return


_ROUTER = _Router()


def install_signal_handlers(callback: Callable[[Trigger], Any],
                            signals: tuple[int, ...] = DEFAULT_SIGNALS,
                            exit_fn: Callable[[int], Any] = os._exit,
                            sigterm_exit_code: int = EXIT_PREEMPTED) -> SignalHandlers:
    """Route ``signals`` to ``callback(Trigger)`` through the C self-pipe (any thread).

    If SIGTERM's previous disposition was SIG_DFL and the callback returns (the
    policy did not exit), the process ends with ``exit_fn(sigterm_exit_code)``.
    Without the native extension this logs a warning and installs nothing.
    """
    sigs = tuple(int(s) for s in signals)
    default = {s: signal.getsignal(s) in (signal.SIG_DFL, None) for s in sigs}
    reg = SignalHandlers(callback, exit_fn, sigterm_exit_code, sigs, default)
    try:
        _ROUTER.add(reg)
    except Exception as exc:  # noqa: BLE001 - no extension / sigaction failed: say so, go on
        logger.warning("signal pipe unavailable (%s): signal triggers disabled", exc)
        return reg
    logger.debug("signal pipe installed for %s", [signal.Signals(s).name for s in sigs])
    return reg
