"""The boundary reads only what changed (issue 15 target 2): an RNG source whose
bytes did not change since the last boundary is not read through its Python API,
the text still decodes to exactly ``codec.dumps(capture_host())`` after every kind
of draw (cached normal samples included), and the layout's identity window runs
natively with the same answers as the Python loop."""
from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
import torch
from helpers import parts

from cudasnap import Snapshotter
from cudasnap.core import layout_watch
from cudasnap.core.state import TrainingState
from cudasnap.format import codec


def HostText(sources):  # noqa: N802 (imported late: the test of the boundary runs without it)
    from cudasnap.core.host_capture import HostText as cls
    from cudasnap.core.rng import capture_rng

    return cls(sources, capture_rng)


def _state() -> TrainingState:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return TrainingState(model, opt, extra={"sched": sched, "gen": torch.Generator()})


def _text(ht, st: TrainingState, step: int) -> bytes:
    """The host value's bytes as the boundary writes them (in pieces)."""
    return b"".join(ht.parts(st, step))


def _same(ht, st: TrainingState, step: int) -> None:
    got = json.loads(_text(ht, st, step))
    want = json.loads(codec.dumps(st.capture_host(step), "host"))
    assert got == want
    assert codec.decode(got, "host")["rng"] == codec.decode(want, "host")["rng"]


DRAWS = {
    "torch.rand": lambda: torch.rand(3),
    "torch.randn(1)": lambda: torch.randn(1),  # caches the second normal sample
    "torch.manual_seed": lambda: torch.manual_seed(7),
    "random.random": random.random,
    "random.gauss": lambda: random.gauss(0.0, 1.0),  # caches gauss_next (instance dict)
    "random.seed": lambda: random.seed(3),
    "np.rand": lambda: np.random.rand(),
    "np.standard_normal": np.random.standard_normal,  # caches has_gauss / gauss
    "np.seed": lambda: np.random.seed(5),
    "np.set_state": lambda: np.random.set_state(np.random.get_state()[:3] + (1, 0.25)),
}


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_text_equals_the_codec_after_each_kind_of_draw(draw):
    st = _state()
    ht = HostText(st.rng_sources)
    assert parts.host_watched(ht) == {"torch", "python", "numpy"}  # all watched on CPython
    _same(ht, st, 0)
    for step in range(1, 5):  # twice in a row: the 2nd call of a cached-sample draw
        DRAWS[draw]()         # changes only the cache, not the generator's words
        _same(ht, st, step)
    _same(ht, st, 5)


def test_unchanged_sources_are_not_read():
    st = _state()
    ht = HostText(st.rng_sources)
    _text(ht, st, 0)
    assert ht.read == 3
    for step in range(1, 4):
        _text(ht, st, step)
    assert ht.read == 3  # nothing drew: no source read again
    torch.rand(2)
    _text(ht, st, 4)
    assert ht.read == 4  # only torch
    random.random()
    np.random.rand()
    _text(ht, st, 5)
    assert ht.read == 6


def test_a_replaced_generator_is_read_every_time(monkeypatch):
    st = _state()
    ht = HostText(st.rng_sources)
    _same(ht, st, 0)
    other = random.Random(11)
    monkeypatch.setattr(random, "getstate", other.getstate)
    _same(ht, st, 1)
    assert "python" not in parts.host_watched(ht)
    other.random()
    _same(ht, st, 2)


def test_a_generator_swapped_out_and_back_is_not_stale(monkeypatch):
    """The Python identity check unwatches a replaced generator for good: HostWatch only
    flags it while replaced, and its byte watch still holds the original's bytes."""
    st = _state()
    ht = HostText(st.rng_sources)
    _same(ht, st, 0)
    other = random.Random(11)
    with monkeypatch.context() as m:
        m.setattr(random, "getstate", other.getstate)
        _same(ht, st, 1)  # the other generator's state
    _same(ht, st, 2)  # the original again, which did not draw meanwhile
    assert "python" not in parts.host_watched(ht)


def test_boundary_does_not_call_the_rng_getters_when_nothing_drew(snap_env):
    """Before: np.random.get_state, random.getstate and torch.get_rng_state ran at
    every boundary (60-150 us, 20-60 us, and a 5 KB allocation each)."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, flush_on_close=False)
    calls: list[str] = []

    def prof(frame, event, arg):  # noqa: ARG001
        if event == "c_call" and getattr(arg, "__name__", "") in (
                "get_state", "getstate", "get_rng_state"):
            calls.append(arg.__name__)
        elif event == "call" and frame.f_code.co_name in ("get_rng_state", "getstate"):
            calls.append(frame.f_code.co_name)

    try:
        snap.boundary(0)
        snap.wait()
        sys.setprofile(prof)
        try:
            for step in range(1, 4):
                opt.step()
                snap.boundary(step)
                snap.wait()
        finally:
            sys.setprofile(None)
        assert calls == []
        torch.rand(1)
        opt.step()
        snap.boundary(4)
        snap.wait()
        meta = json.loads(parts.arena(snap).read_meta(parts.arena(snap).newest_complete()))
        got = codec.decode(meta["host"], "host")["rng"]["torch"]
        assert got == torch.get_rng_state().numpy().tobytes()
    finally:
        snap.close()


def test_native_identity_window(native_C):
    """The identity entries a layout's Watch hands to its LayoutGuard, checked by the
    boundary's one native call (``boundary_check``): a replaced or removed entry is
    found within one full window, and a window of one within n calls."""
    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    d1, d2 = {"x": a, "y": b}, {"z": c}
    entries = [(d1, "x", a), (d1, "y", b), (d2, "z", c)]
    guard = native_C.LayoutGuard([a, b, c])
    layout_watch.Watch(entries).attach(guard)
    assert guard.boundary_check(3) == 0 and guard.boundary_check(10) == 0
    d1["y"] = torch.zeros(1)  # replaced: found within one full window
    assert guard.boundary_check(3) == 1
    d1["y"] = b
    del d2["z"]  # removed key
    assert guard.boundary_check(3) == 1
    d2["z"] = c
    assert guard.boundary_check(3) == 0
    # one entry per call: found within n calls, whatever the cursor
    d1["x"] = torch.zeros(1)
    assert any(guard.boundary_check(1) == 1 for _ in range(3))
    with pytest.raises(Exception, match="tuple"):
        guard.set_entries([(d1, "x")])


def test_value_watch_is_exact(native_C):
    w = native_C.ValueWatch()
    seq = [{"lr": 0.1, "betas": (0.9, 0.99)}, {"lr": 0.1, "betas": (0.9, 0.99)},
           {"lr": 0.1, "betas": [0.9, 0.99]}, {"lr": 0.1, "betas": [0.9, 0.99]},
           {"lr": True}, {"lr": 1}, {"lr": 1.0}, {"lr": -0.0}, {"lr": 0.0}, {"lr": "a"},
           {"lr": b"a"}, {"b": 1, "a": 2}, {"a": 2, "b": 1}, {"a": None}, {"a": [None]},
           {"a": 2**62}]
    got = [w.changed(v) for v in seq]
    assert got == [True, False, True, False] + [True] * 12
    with pytest.raises(ValueError, match="Tensor"):
        w.changed({"x": torch.zeros(1)})
    assert w.changed({"a": 2**62})  # after a refused value: changed again
    with pytest.raises(ValueError, match="64 bits"):
        w.changed(2**70)


def test_rest_of_the_host_state_follows_in_place_changes():
    """A value mutated in place (same objects, new contents) is encoded again."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = TrainingState(model, opt)
    ht = HostText(st.rng_sources)
    _same(ht, st, 0)
    opt.param_groups[0]["lr"] = 0.05
    _same(ht, st, 1)
    opt.param_groups[0]["extra_list"] = [1, 2]
    _same(ht, st, 2)
    opt.param_groups[0]["extra_list"].append(3)  # in place
    _same(ht, st, 3)
    opt.param_groups[0]["t"] = torch.ones(2)  # not a plain value: encoded each time
    _same(ht, st, 4)
    opt.param_groups[0]["t"].add_(1)
    _same(ht, st, 5)
