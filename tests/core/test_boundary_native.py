"""One native call per boundary for each check (issue 15 target 2): ``HostWatch``
(every RNG source, the generator objects' identity, ``random``'s cached gauss, the
CUDA flag and the optimizers' param groups) and ``LayoutGuard.boundary_check``
(signature + identity window + pointer window + re-scan period) see each kind of
change exactly like the per-source / per-check Python path they replace."""
from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from helpers import parts
from test_boundary_reads import DRAWS, HostText, _same

from cudasnap import Snapshotter
from cudasnap.core import rng as core_rng
from cudasnap.core.state import TrainingState


def _bits(ht) -> dict[str, bool]:
    return parts.host_changed(ht)


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_host_watch_flags_exactly_the_source_that_drew(draw):
    ht = HostText(("torch", "numpy", "python"))
    assert all(_bits(ht).values())  # the first look: everything is new
    assert not any(_bits(ht).values())  # nothing drew
    DRAWS[draw]()
    got = _bits(ht)
    src = draw.split(".")[0].replace("np", "numpy").replace("random", "python")
    assert got[src], got
    assert [s for s, on in got.items() if on and s != src] == []
    assert not any(_bits(ht).values())


def test_host_watch_gauss_next_and_a_replaced_generator(monkeypatch):
    ht = HostText(("python",))
    _bits(ht)
    inst = random.getstate.__self__
    inst.gauss_next = 0.5  # only the instance dict changes, not the generator's words
    assert _bits(ht)["python"]
    assert not _bits(ht)["python"]
    inst.gauss_next = -0.0
    assert _bits(ht)["python"]
    inst.gauss_next = 0.0  # same value, other sign: a change
    assert _bits(ht)["python"]
    inst.gauss_next = None
    assert _bits(ht)["python"]
    other = random.Random(3)
    monkeypatch.setattr(random, "getstate", other.getstate)  # not the watched object
    assert _bits(ht)["python"] and _bits(ht)["python"]


def test_host_watch_flag_and_always(native_C):
    hw = native_C.HostWatch()
    ns = types.SimpleNamespace(on=False)
    f, a = hw.add_flag(ns, "on"), hw.add_always()
    assert hw.changed() == 1 << a
    ns.on = True
    assert hw.changed() == (1 << f) | (1 << a)
    assert hw.changed() == (1 << f) | (1 << a)  # read at every boundary while it is set
    ns.on = False
    assert hw.changed() == (1 << f) | (1 << a)  # once more when it turns off
    assert hw.changed() == 1 << a
    del ns.on  # cannot be read: counts as set
    assert hw.changed() & 1 << f
    with pytest.raises(Exception, match="tuple"):
        hw.add_watched([], False, [(ns, "on")])


def test_host_watch_param_groups(native_C):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hw = native_C.HostWatch()
    scalars: dict = {"opt": []}
    hw.set_optim({"opt": opt}, scalars)
    bit = native_C.HostWatch.OPTIM_BIT

    def changed() -> bool:
        return bool(hw.changed() & bit)

    assert changed() and not changed()
    opt.param_groups[0]["lr"] = 1e-3  # the same value again
    assert not changed()
    opt.param_groups[0]["lr"] = 2e-3
    assert changed() and not changed()
    opt.param_groups[0]["betas"] = [0.9, 0.999]  # tuple -> list: the text differs
    assert changed() and not changed()
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(1)))  # the count
    assert changed() and not changed()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    assert changed() and not changed()
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # not a plain value: every time
    assert changed() and changed()
    opt.param_groups[0]["lr"] = 0.1
    assert changed() and not changed()
    scalars["opt"] = [(0, "step")]  # per-parameter scalars: read by the Python path
    assert changed() and changed()


def test_fast_path_text_equals_the_codec_with_groups_extra_and_values():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = TrainingState(model, opt)
    ht = HostText(st.rng_sources)
    for step in range(3):
        _same(ht, st, step)
    assert parts.host_optim_text(ht) is not None  # unchanged groups: their text is reused
    opt.param_groups[0]["lr"] = 0.05
    _same(ht, st, 3)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.2})
    _same(ht, st, 4)
    st.step_values = {"loss": 1.5}
    _same(ht, st, 5)
    st.step_values = {}
    _same(ht, st, 6)
    st.extra["gen"] = torch.Generator()
    _same(ht, st, 7)
    torch.rand(1)
    np.random.rand()
    _same(ht, st, 8)


def test_boundary_check_each_kind_of_change(native_C):
    a, b = torch.zeros(2), torch.zeros(2)
    d = {"a": a, "b": b}
    owner = types.SimpleNamespace(state={1: 1})
    g = native_C.LayoutGuard([a, b])
    g.set_entries([(d, "a", a), (d, "b", b)])
    g.set_sizes([owner], "state")
    g.set_rescan_every(3)
    assert [g.boundary_check(2) for _ in range(3)] == [0, 0, 2]  # the re-scan period
    owner.state[2] = 2  # the signature: lazy optimizer state
    assert g.boundary_check(2) == 1
    del owner.state[2]
    d["b"] = torch.zeros(2)  # an identity entry
    assert g.boundary_check(2) == 1
    d["b"] = b
    # checks 5 and 6: a signature change is not a check of the windows (else [2, 0])
    assert [g.boundary_check(2) for _ in range(2)] == [0, 2]
    a.set_(torch.zeros(4))  # a moved data pointer
    assert g.boundary_check(2) == 1
    with pytest.raises(Exception, match="list"):
        g.set_sizes(owner, "state")


def test_boundary_skips_arena_prep_while_the_arena_fits(snap_env, monkeypatch):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, flush_on_close=False)
    calls: list[int] = []
    real = parts.keeper(snap).ensure

    def ensure(plan, meta_len, *a, **kw):
        calls.append(meta_len)
        return real(plan, meta_len, *a, **kw)

    monkeypatch.setattr(parts.keeper(snap), "ensure", ensure)
    try:
        for step in range(4):
            opt.step()
            snap.boundary(step)
            snap.wait()
        assert len(calls) == 1  # the first boundary only
        snap.invalidate_layout()  # a new layout: asked again
        snap.boundary(4)
        snap.wait()
        assert len(calls) == 2
        cap = parts.arena(snap).meta_capacity
        snap.boundary(5, blob="x" * cap)  # a suffix beyond the meta area: asked again
        snap.wait()
        assert len(calls) == 3 and parts.arena(snap).meta_capacity > cap
        assert snap.stats()["snapshots"] == 6
    finally:
        snap.close()


def test_host_capture_helpers_stay_unwatchable_off_cpython(monkeypatch):
    monkeypatch.setattr(core_rng.sys.implementation, "name", "pypy")  # the watch helpers' home
    ht = HostText(("python", "numpy", "torch"))
    assert parts.host_watched(ht) == {"torch"}
    assert _bits(ht) == {"python": True, "numpy": True, "torch": True}
    assert _bits(ht) == {"python": True, "numpy": True, "torch": False}
