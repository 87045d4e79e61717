"""One environment variable's text, parsed and checked (booleans, numbers, URLs, paths).

The primitives cudasnap.config's ``Settings.from_env`` reads every ``CUDASNAP_*`` variable
with (split from config.py, which owns the variables, their defaults and their table): a
malformed value is a ConfigError naming the variable.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(env: Mapping[str, str], name: str) -> str | None:
    v = env.get(name, "").strip()
    return v or None


def _path(v: str | None) -> Path | None:
    return Path(v) if v is not None else None


def env_bool(env: Mapping[str, str], name: str) -> bool | None:
    """True/False, or None when unset or empty."""
    v = _raw(env, name)
    if v is None:
        return None
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={v!r} is not a boolean (use 1 or 0)")


def env_float(env: Mapping[str, str], name: str, default: float | None = None) -> float | None:
    """A positive finite number, or ``default`` when unset."""
    v = _raw(env, name)
    if v is None:
        return default
    try:
        f = float(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} is not a number") from None
    if not (0 < f < float("inf")):
        raise ConfigError(f"environment variable {name}={v!r} must be a positive number")
    return f


def env_url(env: Mapping[str, str], name: str) -> str | None:
    """An ``http://`` or ``https://`` URL, or None when unset."""
    v = _raw(env, name)
    if v is None:
        return None
    if not v.lower().startswith(("http://", "https://")) or len(v.split("://", 1)[1]) == 0:
        raise ConfigError(f"environment variable {name}={v!r} is not an http:// or https:// URL")
    return v


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """A non-negative int, or ``default`` when unset."""
    v = _raw(env, name)
    if v is None:
        return default
    try:
        i = int(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} is not an integer") from None
    if i < 0:
        raise ConfigError(f"environment variable {name}={v!r} must not be negative")
    return i
