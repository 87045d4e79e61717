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
import logging
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._native import native
from ..format import codec

log = logging.getLogger("cudasnap")

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


# ------------------------------------------------------------------ boundary path
# The boundary does not even read an RNG source that did not change: reading is
# what costs (numpy's get_state() 60-150 us, random.getstate() 20-60 us, and
# torch.get_rng_state()'s 5 KB allocation, which after an optimizer step pays
# glibc's consolidation of every small block the step freed). A native
# ``StateWatch`` compares the raw bytes behind each source with the last
# boundary's instead (well under a microsecond, no allocation).

_MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos


def _object_region(obj: Any) -> tuple[int, int]:
    """(address, bytes) of a fixed-size CPython object's fields after its header."""
    if sys.implementation.name != "cpython":
        raise _Unwatchable("not CPython")
    t = type(obj)
    head = object.__basicsize__
    if t.__itemsize__ or t.__basicsize__ <= head:
        raise _Unwatchable(f"{t.__name__} is not a fixed-size object")
    return id(obj) + head, t.__basicsize__ - head


class _Unwatchable(Exception):
    pass


def _python_watch() -> tuple[Any, tuple[Any, ...]]:
    """Watch of the ``random`` module's generator (the one ``random.getstate`` reads)."""
    inst = getattr(random.getstate, "__self__", None)
    if not isinstance(inst, random.Random):
        raise _Unwatchable("random.getstate is not bound to a random.Random")
    return native().StateWatch([_object_region(inst)]), (inst,)


def _numpy_watch() -> tuple[Any, tuple[Any, ...]]:
    """Watch of NumPy's global RandomState: its own fields (the cached gauss) and the
    Mersenne-Twister state of its bit generator (what ``np.random.get_state`` reads)."""
    rs = getattr(np.random.get_state, "__self__", None)
    bg = getattr(rs, "_bit_generator", None)
    if bg is None or type(bg).__name__ != "MT19937" or type(rs).__name__ != "RandomState":
        raise _Unwatchable("np.random is not a legacy RandomState over MT19937")
    addr = int(bg.ctypes.state_address)
    return native().StateWatch([_object_region(rs), (addr, _MT19937_STATE_BYTES)]), (rs, bg)


def _gauss_key(inst: Any) -> Any:
    g = getattr(inst, "gauss_next", None)
    return (type(g), repr(g))


def _still_watched(src: str, held: tuple[Any, ...]) -> bool:
    """The objects a watch reads are still the ones ``capture_rng`` reads."""
    if src == "python":
        return getattr(random.getstate, "__self__", None) is held[0]
    if src == "numpy":
        rs = getattr(np.random.get_state, "__self__", None)
        return rs is held[0] and rs._bit_generator is held[1]
    return True


class HostText:
    """The host part of a boundary's manifest, reading only what changed.

    Decodes to the same value as ``codec.dumps(state.capture_host(step))``
    (tested). RNG sources: a source whose watched bytes did not change since the
    last boundary reuses its text without being read; "cuda" (and any source
    that cannot be watched) is read every time and encoded when its exact key
    changed. The rest of ``capture_host`` (optimizer hyper-parameters,
    ``extra``, values) is captured as before and encoded per top-level key
    when that key's exact value changed.
    """

    def __init__(self, sources: tuple[str, ...],
                 capture_rng: Callable[[tuple[str, ...]], dict[str, Any]]) -> None:
        self.sources = sources
        self._capture_rng = capture_rng  # cudasnap.core.state.capture_rng (state imports us)
        self.enc = HostEncoder()
        self.read = 0  # RNG states read through their Python API
        self._watch: dict[str, tuple[Any, tuple[Any, ...]]] = {}
        self._text: dict[str, bytes] = {}
        self._rest_text: dict[str, bytes] = {}
        self._values: dict[str, Any] = {}  # native ValueWatch per top-level key
        self._heads: dict[str, str] = {}
        self._gauss: Any = None  # random.Random.gauss_next lives in the instance dict
        for src in sources:
            try:
                if src == "torch":
                    w: tuple[Any, tuple[Any, ...]] = (native().StateWatch([], True), ())
                elif src == "python":
                    w = _python_watch()
                elif src == "numpy":
                    w = _numpy_watch()
                else:
                    continue
            except (_Unwatchable, AttributeError, TypeError, ValueError) as e:
                log.debug("RNG source %s is read at every boundary (%s)", src, e)
                continue
            self._watch[src] = w

    def _rng_parts(self, out: list[bytes]) -> None:
        first = True
        for src in self.sources:
            w = self._watch.get(src)
            if w is not None and not _still_watched(src, w[1]):
                del self._watch[src]  # replaced generator: read at every boundary from now on
                w = None
            # The bytes are compared BEFORE they are read: a draw in between shows
            # as a change at the next boundary, never as a stale text.
            text = self._text.get(src)
            if w is None or w[0].changed() or text is None or (
                    src == "python" and self._gauss != _gauss_key(w[1][0])):
                if src == "python" and w is not None:
                    self._gauss = _gauss_key(w[1][0])  # before the read, as the bytes above
                text = self._read(src)
                if text is None:
                    continue
            if not first:
                out.append(b",")  # a separate piece: ``b"," + text`` would copy the text
            out.append(text)
            first = False

    def _read(self, src: str) -> bytes | None:
        """``"src":<text>`` of one RNG source read now (None: nothing to save)."""
        if src == "cuda" and not torch.cuda.is_initialized():
            got: dict[str, Any] = {}  # what capture_rng gives then, without its ~20 us check
        else:
            got = self._capture_rng((src,))
        if src not in got:
            self._text.pop(src, None)
            return None
        self.read += 1
        text = f'"{src}":{self.enc.part(src, got[src], f"host.rng.{src}")}'.encode()
        self._text[src] = text
        return text

    def parts(self, state: Any, step: int) -> list[bytes]:
        """The host JSON text in pieces (the copy engine writes them one after the other;
        joining them here would allocate the whole text at every boundary)."""
        out = [b'{"rng":{']
        self._rng_parts(out)
        out.append(b"}")
        host = state.capture_host(step, rng=False)
        for k, v in host.items():
            if k != "rng":
                out.append(self._rest(k, v))
        out.append(b"}")
        return out

    def _rest(self, key: str, value: Any) -> bytes:
        """``,"key":<text>``, reused while ``value`` is exactly the same plain value
        (compared natively: a ValueWatch per key; no Python objects, no allocation)."""
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = f",{json.dumps(key)}:"
        if type(value) is int:  # the step: its text is its repr
            return f"{head}{value}".encode()
        w = self._values.get(key)
        if w is None:
            w = self._values[key] = native().ValueWatch()
        try:
            same = not w.changed(value)
        except ValueError:  # not a plain value (a tensor, an object): encoded every time
            self._rest_text.pop(key, None)
            return (head + _dumps(value, "host." + key)).encode()
        text = self._rest_text.get(key)
        if same and text is not None:
            return text
        text = self._rest_text[key] = (head + _dumps(value, "host." + key)).encode()
        return text

    def dumps(self, state: Any, step: int) -> str:
        return b"".join(self.parts(state, step)).decode()
