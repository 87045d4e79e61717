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
    ``host_capture.rng_watch``: no state is read) (``drawn``: the loop draws from
    them between a step's end and its next forward); ``boundary()`` saves that set with
    each snapshot (``DRAWN_KEY``). A restore sets every source now and, with ``again``
    (``rng_restore="first_forward"``, the default), the sources not in the snapshot's set
    once more right before the first forward that is a step's (not a pipeline stage's
    shape inference, which a process runs at its first step and the uninterrupted run ran
    at its own). A snapshot taken before its process knew (its first boundaries) puts
    back again only ``SETUP_DRAWN``; when the resumed loop turns out to draw from one of
    them before its forward, a WARNING says the first step after the resume may differ.

    Call order: the restore calls :meth:`restored`; ``boundary()`` calls
    :meth:`at_boundary`; the forward pre-hook of each registered model (not of its blocks,
    which an activation checkpoint re-runs in the backward) calls :meth:`at_forward` while
    ``armed`` (eager only); the optimizer's step pre-hook calls :meth:`no_forward`.
    """

    def __init__(self, again: bool = True) -> None:
        self.again = again
        self.armed = False  # the forward pre-hook has work: a put-back or a probe
        self.pending: Mapping[str, object] | None = None  # sources to put back again
        self.drawn: set[str] | None = None  # None: not seen yet
        self._guessed: set[str] = set()  # put back again without knowing the loop
        self._probing = False
        self._probes = 0
        # host_capture.rng_watch: a native watch that reads no state (made at the first probe)
        self._watch: tuple[Any, dict[str, int], list[object]] | None = None

    def restored(self, rng: Mapping[str, object], drawn: object = None) -> None:
        """Sets ``rng`` (a decoded snapshot's ``"rng"``) now; ``drawn``: the snapshot's
        ``DRAWN_KEY`` value (None: taken before its process knew)."""
        apply_rng(rng)
        known = isinstance(drawn, list)
        if known:
            self.drawn = {str(x) for x in cast("list[object]", drawn)} | (self.drawn or set())
        skip = set(cast("list[str]", drawn)) if known else set(rng) - set(SETUP_DRAWN)
        again = {k: v for k, v in rng.items() if k not in skip} if self.again else {}
        self.pending = again or None
        self._guessed = set() if known else set(again)
        self.armed = self.pending is not None or self._probing

    def at_boundary(self, sources: tuple[str, ...]) -> None:
        """A boundary: nothing more to put back; the first ones arm a probe."""
        self.pending = None
        self._probing = self._probes < PROBES
        if self._probing:
            self._probes += 1
            if self._watch is None:
                from .host_capture import rng_watch

                self._watch = rng_watch(sources)
            self._watch[0].changed()  # the baseline: the states now
        self.armed = self._probing

    def at_forward(self) -> None:
        """A registered model's forward: the put-back (once), then the probe. A forward run
        to infer shapes (:func:`_inferring_shapes`) is not a step's: it waits."""
        if _inferring_shapes():
            return
        rng, self.pending = self.pending, None
        if rng is not None:
            apply_rng(rng)
        if self._probing and self._watch is not None:
            self._probing = False
            hw, bits, _ = self._watch
            mask = hw.changed()
            moved = {src for src, bit in bits.items() if mask >> bit & 1}
            self.drawn = (self.drawn or set()) | moved
            if moved & self._guessed:
                log.warning("cudasnap: this loop draws from the %s RNG between a step's end and "
                            "its next forward (a data fetch in the main process?), and the "
                            "snapshot it resumed from was taken before cudasnap had seen that "
                            "(a run's first steps): the first step after the resume may differ "
                            "from an uninterrupted run; rng_restore='restore' "
                            "(CUDASNAP_RNG_RESTORE=restore) fits such a loop",
                            "/".join(sorted(moved & self._guessed)))
            self._guessed = set()
        self.armed = False

    def no_forward(self) -> None:
        """An optimizer step before any forward: nothing to put back, no probe."""
        self.pending = None
        self._probing = self.armed = False
