"""The one writer of a slot manifest's bytes.

A shared-memory slot holds its snapshot's manifest (``cudasnap.format.manifest``,
without the ``data`` section) as compact JSON, written in three parts one after
the other::

    prefix  {"format":"cudasnap","format_version":1,<head fields>,"tensors":[...],"host":
    host    {"rng":{"torch":...,"numpy":...},"step":N,"optim":...,"extra":...,"values":...}
    tail    ,"step":N}

The prefix is made once per layout (``encode_prefix``); the host value and the
tail at every boundary, as pieces the copy engine writes one after the other
(``suffix_pieces``: ``host_pieces`` of a ``HostRecord``, then ``slot_tail``). The host
value is written in one pass from a finished record: ``cudasnap.core.host_capture``
captures (reads what changed, keeps the ``Member``s whose value did not change, their
text with them), then ``cudasnap.core.copier`` hands the record here, which encodes the
members not encoded yet and writes the pieces (``host_open``, ``host_member``,
``HOST_CLOSE``). Callers keep the caches (``cudasnap.core.plan_cache``: one prefix per
layout; ``host_capture``: the members); every byte-shaping decision lives here: separators, key order
(``"rng"`` first, then ``"step"``, then the other members in the order given),
the step written twice (inside ``host``, where the codec's host value has it, and
at the top level, which ``validate_manifest`` requires), non-finite floats
(host values: the codec tags them; ``allow_nan=False`` refuses any left).

``encode_host`` and ``encode_slot_manifest`` write the same bytes in one go: the
reference the pieces equal (tested); ``manifest.parse_slot_meta`` reads them.
"""
from __future__ import annotations

import json
from typing import Any

from . import codec

# Compact JSON. The prefix keeps json.dumps' defaults otherwise (as it always has):
# its values are names and integers. Host values are the codec's text (codec.dumps).
_PREFIX_JSON = json.JSONEncoder(separators=(",", ":")).encode

_HOST_OPEN = b'{"rng":{'
_RNG_CLOSE_STEP = b'},"step":'
_RNG_SEP = b","
HOST_CLOSE = b"}"
_TAIL = b',"step":%d}'

_KEYS: dict[str, str] = {}  # key -> its JSON text, for keys written at every boundary


def _key(key: str) -> str:
    """``"key"``: a member name written by hand (outside the codec), cached."""
    text = _KEYS.get(key)
    if text is None:
        if type(key) is not str or key.startswith("__"):
            # The codec would write such an object as a tagged {"__dict__": ...}.
            raise ValueError(f"slot manifest: {key!r} cannot name a host member")
        text = _KEYS[key] = json.dumps(key)
    return text


def encode_prefix(head: dict[str, Any], tensors: list[Any]) -> bytes:
    """The slot manifest up to its host value: ``head``'s fields (``manifest.head``; no
    step), the tensor table, then ``"host":``."""
    return (_PREFIX_JSON(head)[:-1] + ',"tensors":' + _PREFIX_JSON(tensors)
            + ',"host":').encode()


def host_value(value: Any, path: str) -> str:
    """The JSON text of a piece of host state (``cudasnap.format.codec``'s typed JSON)."""
    return codec.dumps(value, path)


def rng_member(source: str, text: str) -> bytes:
    """``"source":text``: one RNG source in the host value's ``"rng"`` object
    (``text``: ``host_value`` of its state)."""
    return f"{_key(source)}:{text}".encode()


def rng_pieces(members: list[bytes]) -> list[bytes]:
    """The ``"rng"`` object's contents from its ``rng_member``s, in pieces (no joined
    copy of the members)."""
    out: list[bytes] = []
    for m in members:
        if out:
            out.append(_RNG_SEP)
        out.append(m)
    return out


def host_open(rng: list[bytes], step: int) -> list[bytes]:
    """The host value's first pieces, ``{"rng":{...},"step":N`` (``rng``: ``rng_pieces``);
    ``host_member``s follow, then ``HOST_CLOSE``."""
    return [_HOST_OPEN, *rng, _RNG_CLOSE_STEP, b"%d" % step]  # str(int(step)), faster


def host_member(key: str, text: str) -> bytes:
    """``,"key":text``: a member of the host value after ``"step"`` (``text``:
    ``host_value``'s)."""
    return f",{_key(key)}:{text}".encode()


EMPTY_EXTRA = host_member("extra", host_value({}, "host.extra"))


class Member:
    """One member of a boundary's host value as a capture hands it over: its ``name``, the
    captured ``value`` and ``text``, its bytes (``rng_member`` / ``host_member``): None until
    ``host_pieces`` encodes it, which then drops the value. A capturer may keep a member and
    hand it again while its value is unchanged: its text is reused, not encoded again."""

    __slots__ = ("name", "value", "text")

    def __init__(self, name: str, value: Any = None, text: bytes | None = None) -> None:
        self.name, self.value, self.text = name, value, text


class HostRecord:
    """A boundary's host state, captured and finished (``cudasnap.core.host_capture``):
    ``rng``, the ``"rng"`` object's members in order; ``members``, the members after
    ``"step"`` in order. ``host_pieces`` writes it."""

    __slots__ = ("rng", "members")

    def __init__(self, rng: list[Member], members: list[Member]) -> None:
        self.rng, self.members = rng, members


def host_pieces(rec: HostRecord, step: int) -> list[bytes]:
    """The host value of ``rec`` in pieces, in one pass: each member not encoded yet is
    encoded (an RNG source's state with ``host_value``; a member after ``"step"`` with
    ``host_value``, an ``int`` by its ``repr``), then ``host_open``, the members,
    ``HOST_CLOSE``; the same bytes as those functions joined by hand (tested)."""
    texts: list[bytes] = []
    for m in rec.rng:
        if m.text is None:
            m.text = rng_member(m.name, host_value(m.value, f"host.rng.{m.name}"))
            m.value = None
        texts.append(m.text)
    out = host_open(rng_pieces(texts), step)
    for m in rec.members:
        if m.text is None:
            v = m.value
            m.text = host_member(m.name, repr(v) if type(v) is int
                                 else host_value(v, "host." + m.name))
            m.value = None
        out.append(m.text)
    out.append(HOST_CLOSE)
    return out


def suffix_pieces(rec: HostRecord, step: int) -> list[bytes]:
    """What a boundary writes after the prefix: ``host_pieces`` then ``slot_tail``."""
    out = host_pieces(rec, step)
    out.append(slot_tail(step))
    return out


def slot_tail(step: int) -> bytes:
    """What follows the host value: the manifest's top-level ``"step"``, and its end."""
    return _TAIL % step


def encode_host(host: dict[str, Any]) -> bytes:
    """The host value (``TrainingState.capture_host``'s) as a boundary writes it, in one
    go: ``"rng"``, ``"step"``, then the other members in ``host``'s order."""
    rng = rng_pieces([rng_member(k, host_value(v, f"host.rng.{k}"))
                      for k, v in host["rng"].items()])
    out = host_open(rng, host["step"])
    out += [host_member(k, host_value(v, "host." + k)) for k, v in host.items()
            if k != "rng" and k != "step"]
    out.append(HOST_CLOSE)
    return b"".join(out)


def encode_slot_manifest(head: dict[str, Any], tensors: list[Any], host: dict[str, Any],
                         step: int) -> bytes:
    """A whole slot manifest in one go (the boundary writes it in pieces)."""
    return encode_prefix(head, tensors) + encode_host(host) + slot_tail(step)
