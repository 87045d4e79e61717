"""Trigger policy and dispatch for cudasnap: signals, progress watchdog, excepthook.

Every trigger (GPU health event, signal, hang, uncaught exception, manual call)
goes to :meth:`Dispatcher.handle`, which asks the :class:`Policy` what to do and
then logs, flushes the snapshot, or flushes and exits the process.

Exit codes used by FLUSH_AND_EXIT (chosen to sit in the unused 64-113 range so a
launcher/scheduler can tell *why* the job stopped and whether to requeue):

* ``EXIT_GPU_LOST = 75``      GPU fell off the bus / NVML reports it lost: requeue on another node.
* ``EXIT_GPU_FAULT = 76``     fatal Xid, double-bit/uncorrected ECC, remap failure, recovery action.
* ``EXIT_HANG = 77``          progress watchdog fired (no step boundary for ``timeout_s``).
* ``EXIT_PREEMPTED = 78``     SIGTERM (scheduler preemption / job cancel): resume elsewhere.
* ``EXIT_PEER_FAILURE = 79``  another rank failed; this rank flushed and stopped.
* ``EXIT_EXCEPTION = 1``      only if a policy maps ``exception`` to flush_exit.

Environment: ``CUDASNAP_POLICY`` overrides the defaults, e.g.
``"thermal=flush,sigusr1=flush_exit,xid.other=flush,hang=flush_exit:90"``.
Keys are trigger kinds or ``xid.fatal`` / ``xid.application`` / ``xid.other``
(``xid`` sets all three); actions are ``ignore``, ``log``, ``flush``,
``flush_exit`` (optionally ``:CODE``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from cudasnap.health import TRIGGER_KINDS, Trigger

logger = logging.getLogger("cudasnap.triggers")

EXIT_GPU_LOST = 75
EXIT_GPU_FAULT = 76
EXIT_HANG = 77
EXIT_PREEMPTED = 78
EXIT_PEER_FAILURE = 79
EXIT_EXCEPTION = 1
EXIT_MANUAL = 0

ENV_POLICY = "CUDASNAP_POLICY"
_HANDLED_ATTR = "__cudasnap_handled__"


class Action(enum.Enum):
    IGNORE = "ignore"
    LOG = "log"
    FLUSH = "flush"
    FLUSH_AND_EXIT = "flush_exit"


_ACTION_NAMES = {"ignore": Action.IGNORE, "log": Action.LOG, "flush": Action.FLUSH,
                 "flush_exit": Action.FLUSH_AND_EXIT, "flush_and_exit": Action.FLUSH_AND_EXIT}

#: Exit code used when a kind is (re)mapped to FLUSH_AND_EXIT without an explicit code.
DEFAULT_EXIT_CODES: dict[str, int] = {
    "xid": EXIT_GPU_FAULT, "ecc_dbe": EXIT_GPU_FAULT, "ecc_uncorrected": EXIT_GPU_FAULT,
    "remap_failure": EXIT_GPU_FAULT, "remap_pending": EXIT_GPU_FAULT, "recovery_action": EXIT_GPU_FAULT,
    "thermal": EXIT_GPU_FAULT, "gpu_lost": EXIT_GPU_LOST, "sigterm": EXIT_PREEMPTED,
    "sigusr1": EXIT_PREEMPTED, "hang": EXIT_HANG, "exception": EXIT_EXCEPTION, "manual": EXIT_MANUAL,
    "peer_failure": EXIT_PEER_FAILURE,
}

Rule = tuple[Action, "int | None"]
_XID_KEYS = ("xid.fatal", "xid.application", "xid.other")
POLICY_KEYS: frozenset[str] = frozenset((TRIGGER_KINDS - {"xid"}) | set(_XID_KEYS))


def _default_rules() -> dict[str, Rule]:
    fx = Action.FLUSH_AND_EXIT
    return {
        "xid.fatal": (fx, EXIT_GPU_FAULT), "xid.application": (Action.FLUSH, None), "xid.other": (Action.LOG, None),
        "ecc_dbe": (fx, EXIT_GPU_FAULT), "ecc_uncorrected": (fx, EXIT_GPU_FAULT),
        "remap_failure": (fx, EXIT_GPU_FAULT), "recovery_action": (fx, EXIT_GPU_FAULT),
        "remap_pending": (Action.FLUSH, None), "gpu_lost": (fx, EXIT_GPU_LOST), "thermal": (Action.LOG, None),
        "sigterm": (fx, EXIT_PREEMPTED), "sigusr1": (Action.FLUSH, None), "hang": (fx, EXIT_HANG),
        "exception": (Action.FLUSH, None), "manual": (Action.FLUSH, None), "peer_failure": (fx, EXIT_PEER_FAILURE),
    }


class Policy:
    """Maps a trigger to an :class:`Action` and (for FLUSH_AND_EXIT) an exit code."""

    def __init__(self, rules: dict[str, Rule] | None = None) -> None:
        self.rules: dict[str, Rule] = _default_rules()
        for key, rule in (rules or {}).items():
            self.set(key, *rule)

    def set(self, key: str, action: Action, code: int | None = None) -> None:
        keys = _XID_KEYS if key == "xid" else (key,)
        for k in keys:
            if k not in POLICY_KEYS:
                raise ValueError(f"unknown policy key {key!r}; expected one of {sorted(POLICY_KEYS | {'xid'})}")
            base = k.split(".")[0]
            exit_code = (code if code is not None else DEFAULT_EXIT_CODES[base]) \
                if action is Action.FLUSH_AND_EXIT else None
            self.rules[k] = (action, exit_code)

    @classmethod
    def parse(cls, spec: str, base: "Policy | None" = None) -> "Policy":
        """Parse ``"key=action[:code],..."`` on top of ``base`` (default policy)."""
        policy = cls(dict(base.rules)) if base is not None else cls()
        for raw in spec.replace(";", ",").split(","):
            entry = raw.strip()
            if not entry:
                continue
            key, sep, value = (s.strip().lower() for s in entry.partition("="))
            act_name, _, code_s = value.partition(":")
            action = _ACTION_NAMES.get(act_name.strip())
            if not sep or action is None:
                raise ValueError(f"bad {ENV_POLICY} entry {entry!r}: expected KEY=ignore|log|flush|flush_exit[:CODE]")
            code: int | None = None
            if code_s:
                if action is not Action.FLUSH_AND_EXIT or not code_s.strip().isdigit():
                    raise ValueError(f"bad {ENV_POLICY} entry {entry!r}: ':CODE' must be an integer "
                                     "and only goes with flush_exit")
                code = int(code_s)
            try:
                policy.set(key, action, code)
            except ValueError as exc:
                raise ValueError(f"bad {ENV_POLICY} entry {entry!r}: {exc}") from None
        return policy

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Policy":
        spec = (os.environ if environ is None else environ).get(ENV_POLICY, "")
        return cls.parse(spec) if spec.strip() else cls()

    def decide(self, trigger: Trigger) -> tuple[Action, int | None]:
        key = trigger.kind
        if key == "xid":
            key = "xid." + (trigger.xid_class or "other")
        rule = self.rules.get(key)
        if rule is None:
            logger.warning("no policy for trigger kind %r; logging only", key)
            return Action.LOG, None
        return rule

    def describe(self) -> str:
        return ", ".join(f"{k}={a.value}" + (f":{c}" if c is not None else "")
                         for k, (a, c) in sorted(self.rules.items()))


# --------------------------------------------------------------------------- signals

_SIGNAL_KINDS = {signal.SIGTERM: "sigterm", signal.SIGUSR1: "sigusr1"}


class SignalHandlers:
    """Installed signal handlers; :meth:`uninstall` restores the previous ones."""

    def __init__(self, callback: Callable[[Trigger], Any], exit_fn: Callable[[int], Any],
                 sigterm_exit_code: int) -> None:
        self.callback = callback
        self.exit_fn = exit_fn
        self.sigterm_exit_code = sigterm_exit_code
        self.previous: dict[int, Any] = {}

    @property
    def installed(self) -> list[int]:
        return list(self.previous)

    def _handler(self, signum: int, frame: types.FrameType | None) -> None:
        kind = _SIGNAL_KINDS.get(signal.Signals(signum), "manual")
        name = signal.Signals(signum).name
        trig = Trigger(kind=kind, code=int(signum), detail=f"received {name}")
        try:
            self.callback(trig)
        except Exception:
            logger.exception("signal callback failed for %s", name)
        prev = self.previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL and signum == signal.SIGTERM:
            # The default action for SIGTERM is to die: do so now that the flush is done.
            logger.warning("%s: flush done, terminating with exit code %d", name, self.sigterm_exit_code)
            _flush_std_streams()
            self.exit_fn(self.sigterm_exit_code)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("cannot restore signal handlers from a non-main thread")
            return
        for signum, prev in self.previous.items():
            try:
                signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("could not restore handler for signal %d: %s", signum, exc)
        self.previous = {}


def install_signal_handlers(callback: Callable[[Trigger], Any],
                            signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1),
                            exit_fn: Callable[[int], Any] = os._exit,
                            sigterm_exit_code: int = EXIT_PREEMPTED) -> SignalHandlers:
    """Route ``signals`` to ``callback(Trigger)``; previous Python handlers are chained after it.

    Only possible from the main thread; elsewhere this logs and installs nothing.
    If SIGTERM's previous handler was SIG_DFL and the callback returns (policy did not
    exit), the process is terminated with ``exit_fn(sigterm_exit_code)``.
    """
    handlers = SignalHandlers(callback, exit_fn, sigterm_exit_code)
    if threading.current_thread() is not threading.main_thread():
        logger.warning("install_signal_handlers called from thread %r, not the main thread: "
                       "signal triggers disabled", threading.current_thread().name)
        return handlers
    for sig in signals:
        try:
            prev = signal.signal(sig, handlers._handler)
        except (OSError, ValueError) as exc:
            logger.warning("could not install handler for signal %s: %s", sig, exc)
            continue
        handlers.previous[int(sig)] = prev
    logger.debug("signal handlers installed for %s", [signal.Signals(s).name for s in handlers.previous])
    return handlers


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


# --------------------------------------------------------------------------- watchdog

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


# --------------------------------------------------------------------------- exceptions

def _exception_trigger(exc_type: type[BaseException], exc: BaseException | None, where: str) -> Trigger:
    return Trigger(kind="exception", detail=f"{exc_type.__name__}: {exc}{where}")


def _mark_handled(exc: BaseException | None) -> bool:
    """Mark ``exc`` as already reported; returns True if it was already marked."""
    if exc is None:
        return False
    if getattr(exc, _HANDLED_ATTR, False):
        return True
    try:
        setattr(exc, _HANDLED_ATTR, True)
    except Exception:
        pass
    return False


class ExceptHooks:
    """Installed exception hooks; :meth:`uninstall` restores the previous ones."""

    def __init__(self, callback: Callable[[Trigger], Any]) -> None:
        self.callback = callback
        self.prev_sys = sys.excepthook
        self.prev_threading = threading.excepthook

    def _report(self, exc_type: type[BaseException], exc: BaseException | None, where: str) -> None:
        if issubclass(exc_type, SystemExit) or _mark_handled(exc):
            return
        try:
            self.callback(_exception_trigger(exc_type, exc, where))
        except Exception:
            logger.exception("exception-trigger callback failed")

    def sys_hook(self, exc_type: type[BaseException], exc: BaseException,
                 tb: types.TracebackType | None) -> None:
        self._report(exc_type, exc, "")
        self.prev_sys(exc_type, exc, tb)

    def threading_hook(self, args: Any) -> None:
        name = getattr(args.thread, "name", "?")
        self._report(args.exc_type, args.exc_value, f" (in thread {name})")
        self.prev_threading(args)

    def uninstall(self) -> None:
        if sys.excepthook == self.sys_hook:
            sys.excepthook = self.prev_sys
        if threading.excepthook == self.threading_hook:
            threading.excepthook = self.prev_threading


def install_excepthook(callback: Callable[[Trigger], Any]) -> ExceptHooks:
    """Wrap ``sys.excepthook`` and ``threading.excepthook``: uncaught exceptions call
    ``callback(Trigger(kind="exception"))`` before the previous hook runs."""
    hooks = ExceptHooks(callback)
    sys.excepthook = hooks.sys_hook
    threading.excepthook = hooks.threading_hook
    return hooks


@contextlib.contextmanager
def guard(callback: Callable[[Trigger], Any]) -> Iterator[None]:
    """Call ``callback(Trigger(kind="exception"))`` for an exception in the block, then re-raise."""
    try:
        yield
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        if not _mark_handled(exc):
            try:
                callback(_exception_trigger(type(exc), exc, ""))
            except Exception:
                logger.exception("exception-trigger callback failed")
        raise


# --------------------------------------------------------------------------- dispatcher

class HistoryEntry(NamedTuple):
    trigger: Trigger
    action: Action
    result: str | None  # flushed path, or None
    outcome: str        # logged|ignored|flushed|flush_failed|coalesced|duplicate|deferred


class Dispatcher:
    """Applies a :class:`Policy` to triggers; thread-safe; at most one flush at a time."""

    def __init__(self, flush: Callable[[Trigger], str | None], policy: Policy | None = None,
                 exit_fn: Callable[[int], Any] = os._exit, dedup_s: float = 1.0,
                 step_fn: Callable[[], int | None] | None = None) -> None:
        self.flush_fn = flush
        self.step_fn = step_fn  # fills Trigger.step when the source did not know it
        self.policy = policy if policy is not None else Policy.from_env()
        self.exit_fn = exit_fn
        self.dedup_s = float(dedup_s)
        self.history: list[HistoryEntry] = []
        self._cond = threading.Condition(threading.Lock())
        self._flushing_thread: int | None = None
        self._flush_gen = 0
        self._last_result: str | None = None
        self._last_ok = True
        self._pending_exit: int | None = None
        self._recent: dict[tuple[str, int | None, int | None], float] = {}

    @property
    def flushing(self) -> bool:
        return self._flushing_thread is not None

    def _record(self, trigger: Trigger, action: Action, result: str | None, outcome: str) -> None:
        with self._cond:
            self.history.append(HistoryEntry(trigger, action, result, outcome))

    def handle(self, trigger: Trigger) -> str | None:
        """Apply the policy to ``trigger``; returns the flushed path (if any)."""
        if trigger.step is None and self.step_fn is not None:
            try:
                trigger = dataclasses.replace(trigger, step=self.step_fn())
            except Exception:
                logger.debug("step_fn failed", exc_info=True)
        action, code = self.policy.decide(trigger)
        logger.warning("trigger %s gpu=%s code=%s class=%s step=%s -> %s%s%s", trigger.kind, trigger.device,
                       trigger.code, trigger.xid_class, trigger.step, action.name,
                       f" (exit {code})" if code is not None else "",
                       f": {trigger.detail}" if trigger.detail else "")
        if action in (Action.IGNORE, Action.LOG):
            self._record(trigger, action, None, "ignored" if action is Action.IGNORE else "logged")
            return None
        me = threading.get_ident()
        key = (trigger.kind, trigger.device, trigger.code)
        with self._cond:
            now = time.monotonic()
            seen = self._recent.get(key)
            if seen is not None and now - seen < self.dedup_s:
                self.history.append(HistoryEntry(trigger, action, None, "duplicate"))
                logger.info("duplicate %s trigger within %.1fs ignored", trigger.kind, self.dedup_s)
                return None
            self._recent[key] = now
            if self._flushing_thread == me:
                # Re-entrant (e.g. a signal handler interrupting our own flush): defer.
                if action is Action.FLUSH_AND_EXIT and self._pending_exit is None:
                    self._pending_exit = code
                self.history.append(HistoryEntry(trigger, action, None, "deferred"))
                logger.warning("%s arrived during a flush in the same thread; deferred", trigger.kind)
                return None
            if self._flushing_thread is not None:
                gen = self._flush_gen
                while self._flush_gen == gen:
                    self._cond.wait()
                result = self._last_result
                self.history.append(HistoryEntry(trigger, action, result, "coalesced"))
                coalesced = True
            else:
                self._flushing_thread = me
                coalesced = False
        if not coalesced:
            result = self._run_flush(trigger, action)
        exit_code = code if action is Action.FLUSH_AND_EXIT else None
        with self._cond:
            if not coalesced and self._pending_exit is not None and exit_code is None:
                exit_code = self._pending_exit
            if not coalesced:
                self._pending_exit = None
        if exit_code is not None:
            logger.error("exiting with code %d after %s (snapshot: %s)", exit_code, trigger.kind, result)
            _flush_std_streams()
            self.exit_fn(exit_code)
        return result

    def _run_flush(self, trigger: Trigger, action: Action) -> str | None:
        result: str | None = None
        ok = True
        t0 = time.monotonic()
        try:
            result = self.flush_fn(trigger)
            logger.warning("flush for %s completed in %.2fs: %s", trigger.kind, time.monotonic() - t0, result)
        except BaseException:
            ok = False
            logger.exception("flush for %s failed after %.2fs", trigger.kind, time.monotonic() - t0)
        finally:
            with self._cond:
                self._flushing_thread = None
                self._last_result = result
                self._last_ok = ok
                self._flush_gen += 1
                self.history.append(HistoryEntry(trigger, action, result, "flushed" if ok else "flush_failed"))
                self._cond.notify_all()
        return result

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no flush is running (True), or ``timeout`` passes (False).

        Returns False at once when called from the flushing thread itself.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._flushing_thread is not None:
                if self._flushing_thread == threading.get_ident():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def manual(self, detail: str = "manual flush", step: int | None = None) -> str | None:
        return self.handle(Trigger(kind="manual", detail=detail, step=step))

    def on_hang(self, stalled_s: float) -> None:
        """Adapter for :class:`Watchdog`: ``Watchdog(t, dispatcher.on_hang)``."""
        self.handle(Trigger(kind="hang", code=None, detail=f"no step boundary for {stalled_s:.1f}s"))

    def counts(self) -> dict[str, int]:
        """Stats: totals by outcome plus ``kind.<kind>`` and ``action.<action>`` counters."""
        with self._cond:
            entries = list(self.history)
        out: dict[str, int] = {"triggers": 0, "flushes": 0, "flush_errors": 0, "coalesced": 0,
                               "duplicates": 0, "deferred": 0}
        for e in entries:  # exactly one entry per handled trigger
            out["triggers"] += 1
            out[f"kind.{e.trigger.kind}"] = out.get(f"kind.{e.trigger.kind}", 0) + 1
            out[f"action.{e.action.value}"] = out.get(f"action.{e.action.value}", 0) + 1
            if e.outcome in ("flushed", "flush_failed"):
                out["flushes"] += 1
                out["flush_errors"] += e.outcome == "flush_failed"
            elif e.outcome == "coalesced":
                out["coalesced"] += 1
            elif e.outcome == "duplicate":
                out["duplicates"] += 1
            elif e.outcome == "deferred":
                out["deferred"] += 1
        return out
