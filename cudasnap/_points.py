"""Named points of the commit path where a test can inject a fault (a kill at a phase of a
flush, a rank dying inside a distributed flush round) or hold a thread (the background
arena set-up, ``arena_prep.hold``).

Product code calls ``reach(point, **info)`` and knows nothing else. Hooks are test code
(``cudasnap._testing``): importing it installs them here (``install``), so the dependency
points from the tests to the product. A process a test starts with CUDASNAP_TEST_KILL_AT or
CUDASNAP_TEST_DIE_IN_FLUSH set (``config.test_hooks_asked``, read once, when this module is
imported) has the hooks loaded for it, by module name; without one, ``reach`` is a global
load and a return.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

Hook = Callable[[str, dict[str, Any]], None]

_hooks: dict[str, Hook] = {}
TEST_HOOKS = "cudasnap._testing"  # loaded by name when the environment asks for it


def install(name: str, hook: Hook) -> None:
    """Registers ``hook(point, info)`` under ``name`` (a second install replaces it)."""
    _hooks[name] = hook


def reach(point: str, **info: Any) -> None:
    """Runs every installed hook at ``point``; nothing when none is installed."""
    if _hooks:
        for hook in list(_hooks.values()):
            hook(point, info)


def _load_if_asked() -> None:
    """At import (the commit path's first module imports this one), so that a process a
    test started with one of the variables has the hooks before its first flush (the native
    phases get armed then too)."""
    from .config import test_hooks_asked

    if test_hooks_asked():
        for mod in ("faults", "dist_hooks"):
            importlib.import_module(f"{TEST_HOOKS}.{mod}")


_load_if_asked()
