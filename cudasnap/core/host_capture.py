"""Host state at a boundary, captured for the codec's JSON text, re-encoding only what changed.

``codec.dumps(state.capture_host(step))`` walks the whole host state in Python
at every boundary, and most of its bytes are RNG states (about 10 KB of
base64) that often do not change between boundaries (NumPy and Python RNGs a
loop never draws from). ``HostEncoder`` keeps each RNG source's member
(``slot_manifest.Member``: its text once encoded) with an exact key of its raw value and
hands a new one (encoded again) only when its key changed; ``HostText`` reads an RNG source
only when its bytes changed, and captures the rest of the host state again per top-level
key when its value changed.

Capture, then encode: ``HostText.capture`` reads what changed and returns a finished
``slot_manifest.HostRecord`` (the members, the unchanged ones with their text); the
caller hands it to ``cudasnap.format.slot_manifest`` (``suffix_pieces`` /
``host_pieces``), which encodes what is new and writes the bytes (separators, key order,
where the step goes). This module only decides what to read and which member to reuse;
it never calls the format back while capturing. The text decodes to the same value as
``codec.dumps(host)`` (tested); only the order of keys differs. Keys are exact: bytes as
they are, floats by ``repr`` (``-0.0`` and ``nan`` differ from ``0.0``), types included
(``True`` is not ``1``); a part holding anything else is encoded afresh each time.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from .._native import native
from ..format import slot_manifest as sm
from ..format.slot_manifest import EMPTY_EXTRA, HostRecord, Member
from .rng import Unwatchable, numpy_watch, python_watch

if TYPE_CHECKING:
    from cudasnap._C import ValueWatch

    from .state import TrainingState

log = logging.getLogger("cudasnap")

_SCALARS = (int, str, bool, bytes, type(None))


class _Unkeyable(Exception):
    pass


def exact_key(v: object) -> object:
    """An exact, immutable stand-in for a plain value (raises _Unkeyable)."""
    t = type(v)
    if t is float:
        return (float, repr(v))
    if t in _SCALARS:
        return (t, v)
    if t is tuple or t is list:
        return (t, tuple(exact_key(x) for x in cast("Iterable[object]", v)))
    if t is dict:
        return (dict, tuple((k, exact_key(x)) for k, x in cast("dict[object, object]", v).items()))
    raise _Unkeyable


class HostEncoder:
    """Per-RNG-source member, kept while its value is exactly the same; one per HostText
    (the training thread's boundary() is its only user)."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[object, Member]] = {}
        self.encoded = 0  # members handed to be encoded afresh (the rest keep their text)

    def member(self, name: str, value: object) -> Member:
        """``name``'s member for ``value``: the last one (its text kept) if ``value`` has
        the same exact key, else a new one (``slot_manifest.host_pieces`` encodes it)."""
        try:
            key = exact_key(value)
        except _Unkeyable:
            self._parts.pop(name, None)
            self.encoded += 1
            return Member(name, value)
        hit = self._parts.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        m = Member(name, value)
        self._parts[name] = (key, m)
        self.encoded += 1
        return m


# ------------------------------------------------------------------ boundary path
# The boundary does not even read an RNG source that did not change: reading is
# what costs (numpy's get_state() 60-150 us, random.getstate() 20-60 us, and
# torch.get_rng_state()'s 5 KB allocation, which after an optimizer step pays
# glibc's consolidation of every small block the step freed). A native
# ``StateWatch`` compares the raw bytes behind each source with the last
# boundary's instead (well under a microsecond, no allocation).

def _still_watched(src: str, held: tuple[object, ...]) -> bool:
    """The objects a watch reads are still the ones ``capture_rng`` reads.

    ``HostWatch`` compares the same identities natively (its private ``still_same``)
    but only flags the source as changed while they differ: its byte watch keeps the
    old generator's bytes, so a generator swapped out and back again would compare
    equal and reuse the other one's text. Once this is False the source is unwatched
    (read at every boundary)."""
    if src == "python":
        return getattr(random.getstate, "__self__", None) is held[0]
    if src == "numpy":
        # (None, when np.random is not bound to a RandomState, is never held[0])
        rs = cast("np.random.RandomState", getattr(np.random.get_state, "__self__", None))
        return rs is held[0] and rs._bit_generator is held[1]
    return True


_NOTHING = Member("")  # a source read last time that had nothing to save


class HostText:
    """The host part of a boundary's manifest, reading only what changed.

    Decodes to the same value as ``codec.dumps(state.capture_host(step))``
    (tested). One native call per boundary (``HostWatch.changed``) says what
    changed since the last boundary, without running Python code or making
    Python objects: each watched RNG source's bytes (and the identity of the
    generator objects ``capture_rng`` reads, and ``random``'s cached
    ``gauss_next``), whether CUDA is initialised (the "cuda" source, read at
    every boundary once it is), and the optimizers' param groups. A source
    that did not change reuses its text without being read; one that cannot be
    watched is read every time and encoded when its exact key changed. The rest
    of ``capture_host`` (``extra``, values, param groups that changed or are not
    plain values) is captured as before and encoded per top-level key when that
    key's exact value changed.

    ``capture`` reads and returns the finished record; ``slot_manifest.host_pieces``
    encodes it (``parts``: both, for one boundary's host value).
    """

    def __init__(self, sources: tuple[str, ...],
                 capture_rng: Callable[[tuple[str, ...]], dict[str, object]]) -> None:
        self.sources = sources
        self._capture_rng = capture_rng  # cudasnap.core.rng.capture_rng
        self.enc = HostEncoder()
        self.read = 0  # RNG states read through their Python API
        self._hw = native().HostWatch()
        self._bit: dict[str, int] = {}
        self._watch: dict[str, tuple[object, ...]] = {}  # watched source -> objects it reads
        self._member: dict[str, Member] = {}  # RNG source -> its member (_NOTHING: none)
        self._rng: list[Member] | None = None  # the RNG members of the last boundary
        self._rng_mask = 0
        self._rest: dict[str, Member] = {}  # top-level key -> its member while unchanged
        self._values: dict[str, ValueWatch] = {}  # native ValueWatch per top-level key
        self._bound: TrainingState | None = None  # the TrainingState whose optimizers _hw watches
        self._optim: Member | None = None  # the "optim" member while the groups did not change
        self._empty_extra = Member("extra", text=EMPTY_EXTRA)
        self._optim_bit = int(self._hw.OPTIM_BIT)
        for src in sources:
            bit = None
            try:
                if src == "torch":
                    bit = self._hw.add_watched([], True)
                    self._watch[src] = ()
                elif src in ("python", "numpy"):
                    regions, same, gauss, held = (python_watch if src == "python"
                                                  else numpy_watch)()
                    bit = self._hw.add_watched(regions, False, same, gauss)
                    self._watch[src] = held
                elif src == "cuda":  # torch.cuda.is_initialized() is `_initialized and ...`
                    bit = self._hw.add_flag(torch.cuda, "_initialized")
            except (Unwatchable, AttributeError, TypeError, ValueError) as e:
                log.debug("RNG source %s is read at every boundary (%s)", src, e)
            self._bit[src] = self._hw.add_always() if bit is None else bit
            self._rng_mask |= 1 << self._bit[src]

    def _rng_members(self, mask: int) -> list[Member]:
        members: list[Member] = []
        for src in self.sources:
            bit = self._bit[src]
            m = self._member.get(src)
            if mask >> bit & 1 or m is None:
                held = self._watch.get(src)
                if held is not None and not _still_watched(src, held):
                    del self._watch[src]  # replaced generator: read at every boundary from now on
                    self._hw.unwatch(bit)
                # The bytes were compared BEFORE they are read: a draw in between shows
                # as a change at the next boundary, never as a stale text.
                m = self._read(src)
            if m is not _NOTHING:
                members.append(m)
        return members

    def _read(self, src: str) -> Member:
        """One RNG source's member read now (``_NOTHING``: nothing to save)."""
        if src == "cuda" and not torch.cuda.is_initialized():
            got: dict[str, object] = {}  # what capture_rng gives then, without its ~20 us check
        else:
            got = self._capture_rng((src,))
        if src not in got:
            self._member[src] = _NOTHING
            return _NOTHING
        self.read += 1
        m = self._member[src] = self.enc.member(src, got[src])
        return m

    def parts(self, state: TrainingState, step: int) -> list[bytes]:
        """The host JSON text in pieces (the copy engine writes them one after the other;
        joining them here would allocate the whole text at every boundary): ``capture``,
        then ``slot_manifest.host_pieces``."""
        return sm.host_pieces(self.capture(state), step)

    def capture(self, state: TrainingState) -> HostRecord:
        """The host state of this boundary (all but its step), read where it changed: the
        finished record ``slot_manifest.host_pieces`` writes."""
        if state is not self._bound:
            self._hw.set_optim(state.optimizers, state._scalar_keys)
            self._bound, self._optim = state, None
        mask = self._hw.changed()
        rng = self._rng
        if rng is None or mask & self._rng_mask:
            rng = self._rng = self._rng_members(mask)
        members: list[Member] = []
        optim = self._optim
        if optim is None or mask & self._optim_bit:
            optim = None
        if optim is None or state.extra or state.step_values:
            host = state.host_members(optim=optim is None)
            for k, v in host.items():
                members.append(self._member_of(k, v))
            if optim is None:
                self._optim = self._rest.get("optim")  # None: not a plain value
            else:
                members.append(optim)
        else:  # nothing but the step changed
            members.append(optim)
            members.append(self._empty_extra)
        return HostRecord(rng, members)

    def _member_of(self, key: str, value: object) -> Member:
        """``key``'s member: the last one (its text kept) while ``value`` is exactly the
        same plain value (compared natively: a ValueWatch per key; no Python objects, no
        allocation), else a new one to encode."""
        if type(value) is int:  # its text is its repr (slot_manifest.host_pieces)
            return Member(key, value)
        w = self._values.get(key)
        if w is None:
            w = self._values[key] = native().ValueWatch()
        try:
            same = not w.changed(value)
        except ValueError:  # not a plain value (a tensor, an object): encoded every time
            self._rest.pop(key, None)
            return Member(key, value)
        m = self._rest.get(key)
        if same and m is not None:
            return m
        m = self._rest[key] = Member(key, value)
        return m
