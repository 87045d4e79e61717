"""Exception triggers: ``sys.excepthook`` and ``threading.excepthook`` wrappers."""
from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from .kinds import Trigger

logger = logging.getLogger("cudasnap.triggers")

_HANDLED_ATTR = "__cudasnap_handled__"


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
