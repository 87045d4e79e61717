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
from typing import cast

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


class RestoredRng:
    """The RNG states of the last restore, put back again at the first forward after it.

    A trainer does more between its checkpoint load and its first step than the
    uninterrupted run did at that point: torchtitan builds its data iterator after
    ``checkpointer.load()``, and ``iter(StatefulDataLoader)`` (any ``DataLoader``) draws
    one number from the default CPU generator. States set inside the load are then one
    draw ahead at the first resumed step, and dropout differs from there on. With
    ``again`` (``rng_restore="first_forward"``, the default) the states are set at the
    restore and once more right before the first forward of a registered model that is a
    step's (not a pipeline stage's shape inference, which a process runs at its first step
    and the uninterrupted run ran at its own: it draws before the states are set).

    Call order: the restore calls :meth:`restored` (it sets the states now); the
    forward pre-hook of each registered model (not of its blocks, which an activation
    checkpoint re-runs in the backward) calls :meth:`at_first_forward` (eager only);
    the optimizer's step pre-hook and ``boundary()`` call :meth:`no_forward` (a step
    without a forward of a registered model keeps the states as the restore set them).
    """

    def __init__(self, again: bool = True) -> None:
        self.again = again
        self.pending: Mapping[str, object] | None = None  # read by the forward pre-hook
        self._torch_after: torch.Tensor | None = None

    def restored(self, rng: Mapping[str, object]) -> None:
        """Sets ``rng`` (a decoded snapshot's ``"rng"``) now; again at the first forward."""
        apply_rng(rng)
        if self.again and rng:
            self.pending = rng
            self._torch_after = torch.get_rng_state()

    def at_first_forward(self) -> None:
        """The first forward after the restore: the states again (once). A forward run to
        infer shapes (:func:`_inferring_shapes`) is not a step's: it waits for the next."""
        if self.pending is None or _inferring_shapes():
            return
        rng, self.pending = self.pending, None
        before = self._torch_after
        moved = before is not None and not torch.equal(torch.get_rng_state(), before)
        apply_rng(rng)
        if moved:
            log.info("cudasnap: random numbers drawn between the restore and the first step "
                     "(a data iterator made after the load, say) were discarded: the RNG "
                     "states are the snapshot's at the first forward (rng_restore)")

    def no_forward(self) -> None:
        """A step or boundary came before any forward: nothing more to put back."""
        self.pending = None
