"""Host state encoding with per-RNG-source reuse (issue 15 target 2): the host value
written with ``HostEncoder.member``'s members (through ``cudasnap.format.slot_manifest``) is
the writer's own bytes and decodes to exactly what ``codec.dumps(capture_host())`` holds,
whichever RNG changed, and unchanged sources are not encoded again."""
from __future__ import annotations

import json
import random

import numpy as np
import torch

from cudasnap.core.host_capture import HostEncoder
from cudasnap.core.state import TrainingState
from cudasnap.format import codec
from cudasnap.format import slot_manifest as sm


def _state() -> TrainingState:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return TrainingState(model, opt, extra={"sched": sched, "gen": torch.Generator()})


def _dumps(enc: HostEncoder, host: dict) -> bytes:
    """The host value with each RNG source's member from ``enc`` (as HostText captures it),
    written by ``slot_manifest.host_pieces``."""
    rec = sm.HostRecord([enc.member(k, v) for k, v in host["rng"].items()],
                        [sm.Member(k, v) for k, v in host.items() if k not in ("rng", "step")])
    return b"".join(sm.host_pieces(rec, host["step"]))


def _same(enc: HostEncoder, st: TrainingState, step: int) -> dict:
    host = st.capture_host(step)
    text = _dumps(enc, host)
    assert text == sm.encode_host(host)  # the cached texts are the writer's bytes
    want = codec.dumps(st.capture_host(step), "host")
    got = json.loads(text)
    assert got == json.loads(want)
    assert codec.decode(got, "host")["rng"] == codec.decode(json.loads(want), "host")["rng"]
    return got


def test_text_equals_codec_whatever_changed():
    st = _state()
    enc = HostEncoder()
    _same(enc, st, 0)
    assert enc.encoded == 3  # torch, python, numpy (no CUDA here)
    _same(enc, st, 1)
    assert enc.encoded == 3  # nothing drew: every source's text reused
    torch.randn(3)
    _same(enc, st, 2)
    assert enc.encoded == 4
    random.random()
    np.random.rand()
    _same(enc, st, 3)
    assert enc.encoded == 6
    st.step_values = {"batch": [1, 2, 3]}
    _same(enc, st, 4)
    assert enc.encoded == 6


def test_exact_keys_sign_of_zero_nan_and_types():
    st = _state()
    enc = HostEncoder()
    for gauss in (0.0, -0.0, float("nan"), 0.5, 0.0):
        s = list(np.random.get_state())
        s[3], s[4] = 1, gauss
        np.random.set_state(tuple(s))
        got = _same(enc, st, 0)
        assert repr(codec.decode(got["rng"]["numpy"], "x")["gauss"]) == repr(gauss)
    enc = HostEncoder()
    a = enc.member("x", {"v": True})
    one = enc.member("x", {"v": 1})
    assert one is not a  # True is not 1: a new member, encoded again
    assert enc.member("x", {"v": 1}) is one  # the same exact value: its member (and text) kept
    assert enc.member("x", {"v": 1.0}) is not one  # 1.0 is not 1
