"""The :class:`Dispatcher`: one entry point for every trigger, at most one flush at a time.

It applies the :class:`~cudasnap.triggers.policy.Policy`, drops duplicates,
coalesces concurrent triggers onto the running flush, defers a re-entrant one
and exits with the policy's code once the flush is done.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .kinds import Trigger
from .policy import Action, Policy

logger = logging.getLogger("cudasnap.triggers")


def flush_std_streams() -> None:
    """Flush stdout/stderr before ``os._exit`` (which skips it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


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
        self.policy = policy if policy is not None else Policy()
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
            flush_std_streams()
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
