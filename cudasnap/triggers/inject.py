"""Scripted fault injection: the same Triggers as NVML, on a script (``CUDASNAP_INJECT``).

Injection syntax (tokens separated by ``,`` or ``;``)::

    KIND[=CODE]@step=N[@dev=D]      fire when notify_step() reaches step N
    KIND[=CODE]@t=SECONDS[@dev=D]   fire SECONDS after start()

e.g. ``xid=79@step=40``, ``ecc_dbe@step=12``, ``sigterm@t=2.5``.  ``hang`` emits
nothing: :meth:`InjectedSource.should_hang` tells the harness to stall so the real
watchdog fires.  ``sigterm``/``sigusr1`` send the real signal to this process.
``exception`` raises :class:`InjectedFault` from ``notify_step`` (training thread).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import re
import signal
import threading
import time

from ..errors import ConfigError
from .kinds import TRIGGER_KINDS, Trigger, TriggerCallback, TriggerKind

logger = logging.getLogger("cudasnap.health")

ENV_INJECT = "CUDASNAP_INJECT"


class InjectedFault(RuntimeError):
    """Raised from ``notify_step`` by an injected ``exception@...`` fault."""


@dataclasses.dataclass
class _Fault:
    kind: str
    code: int | None
    step: int | None
    t: float | None
    device: int | None
    token: str


_TOKEN_RE = re.compile(r"^(?P<kind>[a-z_0-9]+)(?:=(?P<code>-?\d+))?(?P<quals>(?:@[a-z]+=[^@]+)+)$")
_SIGNALS = {"sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1}


def parse_inject(spec: str) -> list[_Fault]:
    """Parse an injection spec; raises ConfigError (a ValueError) naming the bad token."""
    faults: list[_Fault] = []
    for raw in re.split(r"[;,]", spec):
        token = raw.strip()
        if not token:
            continue
        m = _TOKEN_RE.match(token.lower())
        if not m:
            raise ConfigError(f"bad {ENV_INJECT} token {token!r}: expected KIND[=CODE]@step=N or KIND[=CODE]@t=SECONDS")
        kind = m.group("kind")
        if kind not in TRIGGER_KINDS:
            raise ConfigError(f"bad {ENV_INJECT} token {token!r}: unknown kind {kind!r}")
        code = int(m.group("code")) if m.group("code") is not None else None
        if kind == "xid" and code is None:
            raise ConfigError(f"bad {ENV_INJECT} token {token!r}: xid needs a code, e.g. xid=79@step=40")
        step: int | None = None
        t: float | None = None
        device: int | None = None
        for qual in m.group("quals").split("@")[1:]:
            key, _, val = qual.partition("=")
            try:
                if key == "step" and step is None and t is None:
                    step = int(val)
                    if step < 0:
                        raise ValueError
                elif key == "t" and t is None and step is None:
                    t = float(val)
                    if not t >= 0:
                        raise ValueError
                elif key == "dev" and device is None:
                    device = int(val)
                else:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"bad {ENV_INJECT} token {token!r}: bad or repeated qualifier @{qual}") from None
        if step is None and t is None:
            raise ConfigError(f"bad {ENV_INJECT} token {token!r}: needs @step=N or @t=SECONDS")
        if device is None and TriggerKind.of(kind).device:
            device = 0
        faults.append(_Fault(kind, code, step, t, device, token))
    if not faults:
        raise ConfigError(f"empty {ENV_INJECT} spec {spec!r}")
    return faults


_DETAIL = {
    "ecc_dbe": "double-bit ECC error", "ecc_uncorrected": "uncorrected ECC errors increased",
    "remap_failure": "row remapping failure", "remap_pending": "row remap pending",
    "recovery_action": "GPU recovery action requested", "gpu_lost": "GPU is lost",
    "thermal": "thermal slowdown", "peer_failure": "peer rank failed", "manual": "manual trigger",
}


class InjectedSource:
    """Scripted fault source that emits the same Triggers as :class:`NvmlSource`."""

    def __init__(self, spec: str, on_trigger: TriggerCallback | None = None) -> None:
        self.spec = spec
        self.faults = parse_inject(spec)
        self._on_trigger = on_trigger
        step_faults = [f for f in self.faults if f.step is not None and f.kind != "hang"]
        self._by_step = sorted(step_faults, key=lambda f: f.step or 0)
        self._next = 0
        self._timed = sorted((f for f in self.faults if f.t is not None and f.kind != "hang"),
                             key=lambda f: f.t or 0.0)
        hang_steps = [f.step for f in self.faults if f.kind == "hang" and f.step is not None]
        hang_times = [f.t for f in self.faults if f.kind == "hang" and f.t is not None]
        self._hang_step: int | None = min(hang_steps) if hang_steps else None
        self._hang_t: float | None = min(hang_times) if hang_times else None
        self._queue: queue.SimpleQueue[tuple[_Fault, int | None] | None] = queue.SimpleQueue()
        self._step: int | None = None
        self._t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: list[Trigger] = []

    @property
    def available(self) -> bool:
        return True

    def set_callback(self, on_trigger: TriggerCallback) -> None:
        self._on_trigger = on_trigger

    def start(self) -> None:
        if self._thread is not None:
            return
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cudasnap-inject", daemon=True)
        self._thread.start()
        logger.warning("fault injection active: %s", self.spec)

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    def notify_step(self, step: int) -> None:
        """Called at each step boundary from the training thread; amortised O(1)."""
        self._step = step
        faults = self._by_step
        while self._next < len(faults) and (faults[self._next].step or 0) <= step:
            fault = faults[self._next]
            self._next += 1
            self._fire_inline(fault, step)

    def should_hang(self, step: int) -> bool:
        """True once an injected ``hang`` is due: the harness should stall its loop."""
        if self._hang_step is not None and step >= self._hang_step:
            return True
        return (self._hang_t is not None and self._t0 is not None
                and time.monotonic() - self._t0 >= self._hang_t)

    def _fire_inline(self, fault: _Fault, step: int | None) -> None:
        if fault.kind in _SIGNALS:
            logger.warning("injected %s at step %s: sending the real signal", fault.kind, step)
            os.kill(os.getpid(), _SIGNALS[fault.kind])
        elif fault.kind == "exception":
            raise InjectedFault(f"injected fault {fault.token} at step {step}")
        else:
            self._queue.put((fault, step))  # delivered asynchronously, like NVML

    def _run(self) -> None:
        timed = list(self._timed)
        t0 = self._t0 if self._t0 is not None else time.monotonic()
        while not self._stop.is_set():
            timeout = None
            now = time.monotonic() - t0
            while timed and (timed[0].t or 0.0) <= now:
                fault = timed.pop(0)
                if fault.kind == "exception":
                    logger.error("injected exception@t= cannot be raised in the training thread; ignored")
                elif fault.kind in _SIGNALS:
                    self._fire_inline(fault, self._step)
                else:
                    self._deliver(fault, self._step)
            if timed:
                timeout = max(0.0, (timed[0].t or 0.0) - (time.monotonic() - t0))
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                continue
            if item is None:
                continue
            self._deliver(*item)

    def _deliver(self, fault: _Fault, step: int | None) -> None:
        if fault.kind == "xid":
            detail = f"injected Xid {fault.code}"
        else:
            detail = "injected " + _DETAIL.get(fault.kind, fault.kind)
        trig = Trigger(kind=fault.kind, device=fault.device, code=fault.code, detail=detail, step=step)
        self.fired.append(trig)
        logger.warning("injected fault: %s", trig.describe())
        if self._on_trigger is None:
            return
        try:
            self._on_trigger(trig)
        except Exception:
            logger.exception("trigger callback failed for injected %s", trig.describe())

    def describe(self) -> str:
        return f"fault injection ({ENV_INJECT}): " + ", ".join(f.token for f in self.faults)
