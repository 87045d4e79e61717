"""RNG state: which sources a snapshot holds, captured at a boundary, put back at restore.

``capture_rng`` reads the torch, CUDA, numpy and Python RNG states as compact bytes
(per boundary: the host capture calls it, cudasnap.core.host_capture.HostText only for
the sources that changed); ``apply_rng`` sets them back from a decoded snapshot;
``RestoredRng`` puts a restore's states back once more at the first step after it.
"""
from __future__ import annotations

import array
import logging
import random
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any, cast

import numpy as np
import torch

from .._native import native
from ..config import RNG_SOURCES  # the option's one home

log = logging.getLogger("cudasnap.state")


def _bytes_tensor(v: torch.Tensor | bytes) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    return torch.frombuffer(bytearray(v), dtype=torch.uint8)


def capture_rng(sources: tuple[str, ...] = RNG_SOURCES) -> dict[str, object]:
    """RNG states as compact bytes (encoded once as base64 by the codec).

    Per boundary cost matters here (~20 us with all four sources); drop
    "numpy"/"python" from ``rng_sources`` if the training loop never draws
    from them.
    """
    rng: dict[str, object] = {}
    if "torch" in sources:
        rng["torch"] = torch.get_rng_state().numpy().tobytes()
    if "python" in sources:
        version, words, gauss = random.getstate()
        rng["python"] = {"version": version, "state": array.array("I", words).tobytes(),
                         "gauss": gauss}
    if "numpy" in sources:
        np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        _, key, pos, has_gauss, gauss = np_state
        rng["numpy"] = {"key": key.tobytes(), "pos": int(pos), "has_gauss": int(has_gauss),
                        "gauss": float(gauss)}
    if "cuda" in sources and torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()]
    return rng


def apply_rng(rng: Mapping[str, object]) -> None:
    """Sets the RNG states ``capture_rng`` read (decoded host state ``"rng"``); the CUDA
    states only when this process sees as many devices as the snapshot holds."""
    if "torch" in rng:
        torch.set_rng_state(_bytes_tensor(cast("torch.Tensor | bytes", rng["torch"])))
    if "python" in rng:
        p = rng["python"]
        if isinstance(p, dict):
            words = array.array("I")
            words.frombytes(p["state"])
            p = (p["version"], tuple(words.tolist()), p["gauss"])
        random.setstate(cast("tuple[object, ...]", p))
    if "numpy" in rng:
        n = rng["numpy"]
        if isinstance(n, dict):
            key = np.frombuffer(n["key"], dtype=np.uint32).copy()
            n = ("MT19937", key, n["pos"], n["has_gauss"], n["gauss"])
        np.random.set_state(cast("tuple[str, np.ndarray, int, int, float]", n))
    if rng.get("cuda") is not None and torch.cuda.is_available():
        states = [_bytes_tensor(c) for c in cast("list[torch.Tensor | bytes]", rng["cuda"])]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            log.warning("snapshot holds %d CUDA RNG states, this process sees %d devices; "
                        "CUDA RNG not restored", len(states), torch.cuda.device_count())


# The RNG sources' bytes, watched natively (host_capture.HostText at each boundary;
# RestoredRng's probe): reading a state through its API is what costs.
_MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos


def _object_region(obj: object) -> tuple[int, int]:
    """(address, bytes) of a fixed-size CPython object's fields after its header."""
    if sys.implementation.name != "cpython":
        raise Unwatchable("not CPython")
    t = type(obj)
    head = object.__basicsize__
    if t.__itemsize__ or t.__basicsize__ <= head:
        raise Unwatchable(f"{t.__name__} is not a fixed-size object")
    return id(obj) + head, t.__basicsize__ - head


class Unwatchable(Exception):
    pass


# (object, attribute path, expected object): an identity ``HostWatch`` checks natively
_Same = tuple[object, tuple[str, ...], object]
# (regions, identity checks, object whose ``gauss_next`` is compared, held objects)
_SourceWatch = tuple[list[tuple[int, int]], list[_Same], object, tuple[object, ...]]


def python_watch() -> _SourceWatch:
    """Watch of the ``random`` module's generator (the one ``random.getstate`` reads):
    (regions, identity checks, object whose ``gauss_next`` is compared, held objects)."""
    inst = getattr(random.getstate, "__self__", None)
    if not isinstance(inst, random.Random):
        raise Unwatchable("random.getstate is not bound to a random.Random")
    # gauss_next lives in the instance dict, outside the watched bytes: compared apart.
    return [_object_region(inst)], [(random, ("getstate", "__self__"), inst)], inst, (inst,)


def numpy_watch() -> _SourceWatch:
    """Watch of NumPy's global RandomState: its own fields (the cached gauss) and the
    Mersenne-Twister state of its bit generator (what ``np.random.get_state`` reads)."""
    rs = getattr(np.random.get_state, "__self__", None)
    bg = getattr(rs, "_bit_generator", None)
    if bg is None or type(bg).__name__ != "MT19937" or type(rs).__name__ != "RandomState":
        raise Unwatchable("np.random is not a legacy RandomState over MT19937")
    addr = int(bg.ctypes.state_address)
    same: list[_Same] = [(np.random, ("get_state", "__self__"), rs), (rs, ("_bit_generator",), bg)]
    return [_object_region(rs), (addr, _MT19937_STATE_BYTES)], same, None, (rs, bg)


def rng_watch(sources: tuple[str, ...]) -> tuple[Any, dict[str, int], list[object]]:
    """A native watch of the RNG sources alone, for RestoredRng's probe (which sources
    a loop draws from between a boundary and its next forward): (HostWatch, bit of each
    watched source, objects it reads, held). ``changed()`` then says what moved since its
    last call, reading no state (the getters cost what the boundary path avoids). CUDA
    and a source that cannot be watched are not in it."""
    hw = native().HostWatch()
    bits: dict[str, int] = {}
    held: list[object] = []
    for src in sources:
        try:
            if src == "torch":
                bits[src] = hw.add_watched([], True)
            elif src in ("python", "numpy"):
                regions, same, gauss, objs = (python_watch if src == "python"
                                              else numpy_watch)()
                bits[src] = hw.add_watched(regions, False, same, gauss)
                held.extend(objs)
        except (Unwatchable, AttributeError, TypeError, ValueError) as e:
            log.debug("RNG source %s is not probed (%s)", src, e)
    return hw, bits, held


# Frames of a forward that is not a training step's: torch.distributed.pipelining runs a real
# forward (and backward) of each stage at a process's first step to learn the shapes it sends
# (``PipelineStage._forward_metadata_inference``; ``_shape_inference`` before torch 2.11),
# drawing from the RNG as dropout does. The uninterrupted run drew them at its first step.
_SHAPE_INFERENCE = frozenset({"_forward_metadata_inference", "_backward_metadata_inference",
                              "_shape_inference"})


def _inferring_shapes(depth: int = 48) -> bool:
    """Called from a forward pre-hook: is this forward a pipeline stage's shape inference?"""
    f: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name in _SHAPE_INFERENCE:
            return True
        f = f.f_back
    return False


# The ``boundary()`` value key of the sources a loop draws from between a step's end and its
# next forward (RestoredRng.drawn), saved with each snapshot once seen; hidden from
# ``Snapshotter.values``. (A dotted name: no keyword argument of the user's can clash.)
DRAWN_KEY = "cudasnap.rng_drawn_before_forward"
# Sources a trainer's set-up after its checkpoint load draws from: ``iter(DataLoader)``
# seeds its sampler and workers from the CPU generator (CUDA: a device-side set-up).
SETUP_DRAWN = ("torch", "cuda")
PROBES = 3  # boundaries of each process whose next forward is checked for draws


class RestoredRng:
    """When a restore's RNG states are put back: at the restore, and per source again at the
    first forward after it, by what the loop draws from where.

    A trainer does more between its checkpoint load and its first step than the
    uninterrupted run did at that point: torchtitan builds its data iterator after
    ``checkpointer.load()``, and ``iter(StatefulDataLoader)`` (any ``DataLoader``) draws
    from the default CPU generator; states set inside the load were then one draw ahead
    at the first resumed step, and dropout differed from there on. A loop whose data
    fetch draws (noise or augmentation in the main process) needs the opposite: the
    states at the restore, its fetch drawing from them as the uninterrupted run did.

    So each process checks, at the first forward after each of its first ``PROBES``
    boundaries, which sources moved since the boundary (a native watch of their bytes,
    ``rng_watch``: no state is read): ``drawn``, the sources the loop draws from between a
    step's end and its next forward. Once that holds a ``SETUP_DRAWN`` source, each
    snapshot saves it (``DRAWN_KEY``, a boundary value). A restore sets every source now
    and, with ``again`` (``rng_restore="first_forward"``, the default), once more right
    before the first forward that is a step's (not a pipeline stage's shape inference,
    which a process runs at its first step and the uninterrupted run ran at its own) the
    sources the loop does not draw from before its forward: those not in the snapshot's
    ``DRAWN_KEY``, or, without one, ``SETUP_DRAWN``. What is then left not exact is named
    at WARNING by the resumed process's probe, never silent: a loop that draws from a
    ``SETUP_DRAWN`` source in its fetch resumed from a snapshot of its first steps (taken
    before it was seen), or a set-up after the load that drew from numpy or ``random``.

    Call order: the restore calls :meth:`restored`; ``boundary()`` calls
    :meth:`at_boundary`; the forward pre-hook of each registered model (not of its blocks,
    which an activation checkpoint re-runs in the backward) calls :meth:`at_forward` while
    ``armed`` (eager only); the optimizer's step pre-hook calls :meth:`no_forward`.
    """

    def __init__(self, again: bool = True) -> None:
        self.again = again
        self.armed = False  # the forward pre-hook has work: a put-back or a probe
        self.pending: Mapping[str, object] | None = None  # sources to put back again
        self.drawn: set[str] = set()  # sources seen drawn from before a forward
        # what boundary() saves under DRAWN_KEY: the drawn sources once one of them is in
        # SETUP_DRAWN (else nothing: a snapshot without the key puts back SETUP_DRAWN)
        self.saved: list[str] | None = None
        self._guessed: set[str] = set()  # put back again without knowing the loop
        self._since_restore = False  # the first forward after a restore reads the watch
        self._setup_moved: set[str] = set()  # moved between the restore and that forward
        self._probing = False
        self._probes = 0
        self._watch: tuple[Any, dict[str, int], list[object]] | None = None  # rng_watch

    def _moved(self, sources: tuple[str, ...]) -> set[str]:
        """The watched sources that moved since the last call (the first: all of them)."""
        if self._watch is None:
            self._watch = rng_watch(sources)
        hw, bits, _ = self._watch
        mask = hw.changed()
        return {src for src, bit in bits.items() if mask >> bit & 1}

    def restored(self, rng: Mapping[str, object], drawn: object = None,
                 sources: tuple[str, ...] = RNG_SOURCES) -> None:
        """Sets ``rng`` (a decoded snapshot's ``"rng"``) now; ``drawn``: the snapshot's
        ``DRAWN_KEY`` value (None: the loop draws from no SETUP_DRAWN source before its
        forward, or the snapshot was taken before its process knew)."""
        apply_rng(rng)
        known = isinstance(drawn, list)
        if known:
            self.drawn |= {str(x) for x in cast("list[object]", drawn)}
            self.saved = sorted(self.drawn)
        skip = set(cast("list[str]", drawn)) if known else set(rng) - set(SETUP_DRAWN)
        again = {k: v for k, v in rng.items() if k not in skip} if self.again else {}
        self.pending = again or None
        self._guessed = set() if known else set(again)
        self._moved(sources)  # the baseline: the states as restored
        self._since_restore = True
        self.armed = True

    def at_boundary(self, sources: tuple[str, ...]) -> None:
        """A boundary: nothing more to put back; the first ones arm a probe."""
        self.pending = None
        self._since_restore = False
        self._probing = self._probes < PROBES
        if self._probing:
            self._probes += 1
            self._moved(sources)  # the baseline: the states now
        self.armed = self._probing

    def at_forward(self) -> None:
        """A registered model's forward: the put-back (once), then the probe. A forward run
        to infer shapes (:func:`_inferring_shapes`) is not a step's: it waits."""
        if _inferring_shapes():
            return
        if self._since_restore:  # what moved between the restore and now, not put back
            self._since_restore = False
            self._setup_moved = self._moved(()) - set(self.pending or ())
        rng, self.pending = self.pending, None
        if rng is not None:
            apply_rng(rng)
        if self._probing:
            self._probing = False
            self._probed(self._moved(()))
        self.armed = False

    def _probed(self, moved: set[str]) -> None:
        """The probe's answer: ``moved`` between a boundary and its next forward."""
        self.drawn |= moved
        if self.drawn & set(SETUP_DRAWN):
            self.saved = sorted(self.drawn)
        late = moved & self._guessed
        if late:
            log.warning("cudasnap: this loop draws from the %s RNG between a step's end and "
                        "its next forward (a data fetch in the main process?), and the "
                        "snapshot it resumed from was taken before cudasnap had seen that "
                        "(a run's first steps): the first step after the resume may differ "
                        "from an uninterrupted run; rng_restore='restore' "
                        "(CUDASNAP_RNG_RESTORE=restore) fits such a loop",
                        "/".join(sorted(late)))
        setup = self._setup_moved - moved
        if setup:
            log.warning("cudasnap: something between the restore and the first step drew from "
                        "the %s RNG, which this loop does not draw from before its forward (a "
                        "set-up after the checkpoint load?): the first step after the resume "
                        "may differ from an uninterrupted run", "/".join(sorted(setup)))
        self._guessed, self._setup_moved = set(), set()

    def no_forward(self) -> None:
        """An optimizer step before any forward: nothing to put back, no probe."""
        self.pending = None
        self._since_restore = self._probing = self.armed = False
