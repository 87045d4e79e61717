"""Issue 45 item 1: tensor-subclass state (torchao's low-bit optimizer state, any traceable
wrapper subclass) is snapshotted as its ``__tensor_flatten__`` inner tensors and restored
bitwise (cudasnap.core.wrapped).

Before this, the first ``boundary()`` of a job with torchao's AdamW8bit raised "a tensor
subclass whose bytes do not live in its own storage (sharded DTensor state ...) use
torch.distributed.checkpoint". Kills from outside: tests/e2e/test_kill_real_stacks.py
(``torchao-8bit``/``-4bit``/``-fp8``, ``hf-lora-8bit``); FSDP2:
tests/distributed/test_subclass_fsdp2.py."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from cudasnap.core.state import TrainingState
from cudasnap.errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot
from cudasnap.format.paths import MANIFEST
from cudasnap.snapshotter import Snapshotter

ao = pytest.importorskip("torchao.optim", reason="torchao is not installed "
                         "(requirements-extras.txt)")
OPTIMS = {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 96 x 128 = 12,288 elements: quantized (torchao: >= 4,096)
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))


def _make(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = _model()
    return m, getattr(ao, OPTIMS[kind])(m.parameters(), lr=1e-2)


def _step(m: torch.nn.Module, o: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(i))
    m(x).square().mean().backward()
    o.step()
    o.zero_grad(set_to_none=True)


def _state(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, a subclass as its inner tensors."""
    out = {f"p.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for i, st in enumerate(o.state.values()):
        for k, v in st.items():
            if type(v) is not torch.Tensor:
                attrs, _ = v.__tensor_flatten__()
                out.update({f"o{i}.{k}.{a}": getattr(v, a).clone() for a in attrs})
                out[f"o{i}.{k}.class"] = torch.tensor(hash(type(v).__qualname__))
            else:
                out[f"o{i}.{k}"] = v.clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def _snap(m: torch.nn.Module, o: torch.optim.Optimizer, d: Path) -> Snapshotter:
    return Snapshotter(m, o, directory=d, health=False, copy_threads=1,
                       job=f"sub-{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("kind", list(OPTIMS))
def test_low_bit_state_restores_bitwise_into_a_new_optimizer(tmp_path: Path, kind: str) -> None:
    """Disk and shared memory: a new model and optimizer (torchao makes its state only at
    the first step) resume at step 3 and train to 6 exactly as an uninterrupted run."""
    m, o = _make(kind)
    for i in range(6):
        _step(m, o, i)
    ref = _state(m, o)
    assert any(k.endswith(".codes") for k in ref), "the state is quantized"
    for source in ("disk", "shm"):
        d = tmp_path / source
        m, o = _make(kind)
        snap = _snap(m, o, d)
        for i in range(3):
            _step(m, o, i)
            snap.boundary(i)
        if source == "disk":
            snap.flush()
            snap.close()
        else:
            snap.wait()
            snap.close(keep_arena=True)
            assert snap.arena_path.exists()
        m2, o2 = _make(kind)
        snap2 = Snapshotter(m2, o2, directory=d, health=False, copy_threads=1, job=snap.job)
        try:
            start = snap2.restore_latest()
            assert start == 3
            assert snap2.stats()["restore"]["source"] == source
            v = next(iter(o2.state.values()))["exp_avg"]
            assert type(v).__name__.startswith("OptimState"), type(v)
            for i in range(start, 6):
                _step(m2, o2, i)
                snap2.boundary(i)
        finally:
            snap2.close(keep_arena=False)
        assert _same(ref, _state(m2, o2)) == [], (kind, source)


def test_rollback_writes_into_the_live_subclass_in_place(tmp_path: Path) -> None:
    """The same optimizer (a NaN loss rolled back): the bytes go into the live
    OptimState8bit's inner tensors; the objects stay the ones torchao holds."""
    m, o = _make("8bit")
    snap = _snap(m, o, tmp_path)
    try:
        for i in range(3):
            _step(m, o, i)
            snap.boundary(i)
        snap.wait()
        at2 = _state(m, o)
        objs = {id(v) for st in o.state.values() for v in st.values()}
        inner = {id(v.codes) for st in o.state.values() for v in st.values() if hasattr(v, "codes")}
        _step(m, o, 3)
        _step(m, o, 4)
        assert _same(at2, _state(m, o)) != []
        assert snap.rollback() == 3
        assert _same(at2, _state(m, o)) == []
        assert {id(v) for st in o.state.values() for v in st.values()} == objs
        assert {id(v.codes) for st in o.state.values() for v in st.values()
                if hasattr(v, "codes")} == inner
    finally:
        snap.close(keep_arena=False)


def _flushed_entries(kind: str, d: Path) -> list[dict[str, Any]]:
    """The manifest's tensor table of a one-step snapshot flushed to ``d``."""
    m, o = _make(kind)
    snap = _snap(m, o, d)
    try:
        _step(m, o, 0)
        snap.boundary(0)
        path = Path(snap.flush())
    finally:
        snap.close()
    return list(json.loads((path / MANIFEST).read_text())["tensors"])


def test_the_manifest_records_each_inner_tensor_with_its_subclass(tmp_path: Path) -> None:
    ents = _flushed_entries("4bit", tmp_path)
    w = {e["name"]: e["wrapper"] for e in ents if "wrapper" in e}
    rec = w["optim.state.0.exp_avg.codes"]
    assert rec["class"] == "torchao.optim.subclass_4bit:OptimState4bit"
    assert rec["of"] == "optim.state.0.exp_avg" and rec["attr"] == "codes"
    assert rec["inner"] == ["codes", "scale", "qmap"] and rec["shape"] == [96, 128]
    assert {"__dtype__": "float32"} in rec["ctx"]  # the context, as typed JSON
    codes = next(e for e in ents if e["name"] == "optim.state.0.exp_avg.codes")
    assert codes["dtype"] == "uint8" and codes["state_key"] == "exp_avg"
    assert "optim.state.0.exp_avg" not in {e["name"] for e in ents}
    # the small bias state stays a plain tensor
    assert "optim.state.1.exp_avg" in {e["name"] for e in ents}


def test_a_corrupt_wrapper_record_is_refused_before_any_byte(tmp_path: Path) -> None:
    from cudasnap.format.manifest import validate_tensors

    ents = _flushed_entries("8bit", tmp_path)
    bad = [dict(e) for e in ents]
    i = next(i for i, e in enumerate(bad) if "wrapper" in e)
    bad[i]["wrapper"] = {**bad[i]["wrapper"], "inner": "codes"}
    with pytest.raises(CorruptSnapshot, match="wrapper inner"):
        validate_tensors(bad, 1 << 40, "t")


def test_a_subclass_whose_module_is_not_imported_is_refused(tmp_path: Path) -> None:
    from cudasnap.core import wrapped

    rec = {"of": "x", "class": "not_imported_mod:Thing", "ctx": None, "inner": ["a"],
           "shape": [1], "stride": [1], "dtype": "float32"}
    with pytest.raises(IncompatibleSnapshot, match="not imported .*not_imported_mod"):
        wrapped.rebuild(rec, {"a": torch.zeros(1)}, "restore")


# ----------------------------------------------- any traceable subclass (torch's TwoTensor)
def _two() -> Any:
    return pytest.importorskip("torch.testing._internal.two_tensor").TwoTensor


def test_a_traceable_subclass_buffer_is_snapshotted_and_restored(tmp_path: Path) -> None:
    two = _two()
    m = torch.nn.Linear(4, 4)
    m.register_buffer("tt", two(torch.arange(6.0), torch.arange(6.0) * 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    snap = _snap(m, opt, tmp_path)
    try:
        snap.boundary(0)
        snap.flush()
    finally:
        snap.close()
    m2 = torch.nn.Linear(4, 4)
    m2.register_buffer("tt", two(torch.zeros(6), torch.zeros(6)))
    snap2 = Snapshotter(m2, torch.optim.SGD(m2.parameters(), lr=0.1), directory=tmp_path,
                        health=False, copy_threads=1, job=snap.job)
    try:
        assert snap2.restore_latest() == 1
    finally:
        snap2.close(keep_arena=False)
    assert torch.equal(m2.tt.a, torch.arange(6.0)) and torch.equal(m2.tt.b, torch.arange(6.0) * 2)
    # a live model whose tensor is plain where the snapshot had the subclass: refused
    m3 = torch.nn.Linear(4, 4)
    m3.register_buffer("tt", torch.zeros(6))
    snap3 = Snapshotter(m3, torch.optim.SGD(m3.parameters(), lr=0.1), directory=tmp_path,
                        health=False, copy_threads=1, job=snap.job)
    try:
        with pytest.raises(IncompatibleSnapshot, match="inner tensor of a .*TwoTensor"):
            snap3.restore_latest()
    finally:
        snap3.close(keep_arena=False)


def test_an_inner_tensor_replaced_rebuilds_the_layout(tmp_path: Path) -> None:
    """The plan holds the inner tensors' addresses: one replaced by a new object (not
    written in place) is seen by the identity check and snapshotted from the new one."""
    two = _two()
    m = torch.nn.Linear(2, 2)
    m.register_buffer("tt", two(torch.zeros(4), torch.zeros(4)))
    snap = _snap(m, torch.optim.SGD(m.parameters(), lr=0.1), tmp_path)
    try:
        snap.boundary(0)
        snap.wait()
        m.tt.b = torch.full((4,), 7.0)  # a new inner tensor, not a write into the old one
        snap.boundary(1)
        path = Path(snap.flush())
    finally:
        snap.close()
    from cudasnap.tools.shards import load_tensors

    tensors, _ = load_tensors(path.parent, step=1)
    assert torch.equal(tensors["model.tt.b"], torch.full((4,), 7.0))


def test_subclasses_cudasnap_cannot_snapshot_are_refused_with_the_reason() -> None:
    two = _two()

    class Opaque:  # a context JSON cannot hold without pickle
        pass

    class OddCtx(two):
        def __tensor_flatten__(self):  # type: ignore[no-untyped-def]
            return ["a", "b"], Opaque()

    m = torch.nn.Linear(2, 2)
    m.register_buffer("odd", OddCtx(torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ConfigError, match=r"model\.odd is a .*OddCtx whose __tensor_flatten__ "
                                          r"context cannot be recorded without pickle"):
        TrainingState(m, None).live_tensors()
    m = torch.nn.Linear(2, 2)
    m.register_buffer("nest", two(two(torch.zeros(2), torch.zeros(2)), torch.zeros(2)))
    with pytest.raises(ConfigError, match=r"model\.nest\.a is a .*TwoTensor inside a .*"
                                          r"one level of tensor subclass"):
        TrainingState(m, None).live_tensors()


def test_the_arena_estimate_counts_the_inner_tensors() -> None:
    """A Snapshotter made after the first step sizes its arena from the live state: a
    subclass counts as its inner tensors (1-byte codes), not as its fp32 outer shape."""
    from cudasnap.core.arena_size import estimate_state_bytes

    m, o = _make("8bit")
    _step(m, o, 0)
    st = TrainingState(m, o)
    nbytes, count = estimate_state_bytes(st)
    lts = st.live_tensors()
    assert count == len(lts)
    planned = sum(lt.nbytes for lt in lts)
    assert planned <= nbytes < planned + (count + 1) * 2 * 4096


def test_an_inner_tensor_held_outside_the_instance_dict_is_refused() -> None:
    two = _two()

    class Hidden(two):
        @property
        def b(self):  # type: ignore[no-untyped-def]
            return self.__dict__["_b"]

        @b.setter
        def b(self, v):  # type: ignore[no-untyped-def]
            self.__dict__["_b"] = v

    m = torch.nn.Linear(2, 2)
    m.register_buffer("h", Hidden(torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ConfigError, match=r"model\.h: .*Hidden holds its inner tensor 'b' "
                                          r"outside its instance __dict__"):
        TrainingState(m, None).live_tensors()
