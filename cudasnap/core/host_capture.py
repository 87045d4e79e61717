"""Host state at a boundary as the codec's JSON text, re-encoding only what changed.

``codec.dumps(state.capture_host(step))`` walks the whole host state in Python
at every boundary, and most of its bytes are RNG states (about 10 KB of
base64) that often do not change between boundaries (NumPy and Python RNGs a
loop never draws from). ``HostEncoder`` keeps the JSON text of each RNG source
with an exact key of its raw value and encodes a source again only when its key
changed; the rest of the host state goes through ``codec.dumps`` as before.

The text decodes to the same value as ``codec.dumps(host)`` (tested); only the
order of keys differs. Keys are exact: bytes as they are, floats by ``repr``
(``-0.0`` and ``nan`` differ from ``0.0``), types included (``True`` is not
``1``); a part holding anything else is encoded afresh each time.
"""
from __future__ import annotations

import json
from typing import Any

from ..format import codec

_SCALARS = (int, str, bool, bytes, type(None))


class _Unkeyable(Exception):
    pass


def exact_key(v: Any) -> Any:
    """An exact, immutable stand-in for a plain value (raises _Unkeyable)."""
    t = type(v)
    if t is float:
        return (float, repr(v))
    if t in _SCALARS:
        return (t, v)
    if t is tuple or t is list:
        return (t, tuple(exact_key(x) for x in v))
    if t is dict:
        return (dict, tuple((k, exact_key(x)) for k, x in v.items()))
    raise _Unkeyable


def _dumps(value: Any, path: str) -> str:
    return json.dumps(codec.encode(value, path), separators=(",", ":"), allow_nan=False)


class HostEncoder:
    """Per-RNG-source cache of encoded text; one per TrainingState (the training
    thread's boundary() is its only user)."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[Any, str]] = {}
        self.encoded = 0  # parts encoded afresh (the rest reused their text)

    def part(self, name: str, value: Any, path: str) -> str:
        try:
            key = exact_key(value)
        except _Unkeyable:
            self._parts.pop(name, None)
            self.encoded += 1
            return _dumps(value, path)
        hit = self._parts.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        text = _dumps(value, path)
        self._parts[name] = (key, text)
        self.encoded += 1
        return text

    def dumps(self, host: dict[str, Any]) -> str:
        """``codec.dumps(host, "host")`` for ``TrainingState.capture_host``'s value."""
        rng = host.get("rng")
        if not isinstance(rng, dict) or not rng or not all(
                isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in rng):
            return codec.dumps(host, "host")
        rest = {k: v for k, v in host.items() if k != "rng"}
        text = ",".join(f'"{k}":{self.part(k, v, f"host.rng.{k}")}' for k, v in rng.items())
        tail = codec.dumps(rest, "host")
        return '{"rng":{' + text + "}" + ("," + tail[1:] if tail != "{}" else "}")
