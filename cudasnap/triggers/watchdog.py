"""Progress watchdog: a hang is no step boundary for ``timeout_s`` seconds."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("cudasnap.triggers")


class Watchdog:
    """Fires ``on_hang(stalled_seconds)`` once when no :meth:`kick` came for ``timeout_s``.

    Armed by the first kick.  ``kick()`` only stores ``time.monotonic()``.
    """

    def __init__(self, timeout_s: float, on_hang: Callable[[float], Any], poll_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s) if poll_s is not None else max(0.005, min(1.0, self.timeout_s / 10))
        self.on_hang = on_hang
        self.last_step: int | None = None
        self.fired = False
        self._last: float | None = None
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cudasnap-watchdog", daemon=True)
            self._thread.start()
        return self

    def kick(self, step: int | None = None) -> None:
        self._last = time.monotonic()
        if step is not None:
            self.last_step = step
        if self._thread is None:
            self.start()

    def pause(self) -> None:
        """Suspend hang detection (e.g. around a long eval or checkpoint); nests."""
        self._paused += 1

    def resume(self) -> None:
        self._paused = max(0, self._paused - 1)
        if self._last is not None:
            self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(1.0, 2 * self.poll_s))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            last = self._last
            if last is None or self._paused:
                continue
            stalled = time.monotonic() - last
            if stalled >= self.timeout_s:
                self.fired = True
                logger.error("watchdog: no step boundary for %.1fs (limit %.1fs, last step %s)",
                             stalled, self.timeout_s, self.last_step)
                try:
                    self.on_hang(stalled)
                except Exception:
                    logger.exception("watchdog on_hang callback failed")
                return
