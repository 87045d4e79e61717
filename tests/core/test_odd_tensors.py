"""Odd tensors in the state (issue 22 item 5): each is snapshotted and restored bitwise (flush,
then a restore from disk into a freshly built model in a new Snapshotter), or refused with ONE
ConfigError naming it (by its state name) and why, at construction (model, ``extra``) or at the
first boundary for state that appears later (optimizer state, ``boundary(**values)``); never a
crash, never a raw torch error, never an arena left behind by a refusal.

Before: a meta-device buffer segfaulted the copy workers (exit 139) leaving an arena in
/dev/shm; a NestedTensor raised torch's RuntimeError from inside cudasnap.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import cudasnap
from cudasnap.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")


def _raw(t: torch.Tensor) -> tuple[list[int], torch.dtype, bytes]:
    """Shape, dtype and bytes of a tensor's elements (bitwise, any dtype, any strides)."""
    t = t.detach()
    data = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return list(t.shape), t.dtype, data


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, object]:
    out: dict[str, object] = {f"model.{k}": _raw(v) for k, v in model.state_dict().items()}
    if opt is not None:
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"optim.{i}.{k}"] = _raw(v) if isinstance(v, torch.Tensor) else v
    return out


def _round_trip(snap_env, build: Callable[[int], torch.nn.Module],
                batch: Callable[[], torch.Tensor] = lambda: torch.randn(3, 4)) -> None:
    """Train one step, snapshot, flush; restore into ``build(1)`` (other contents) in a new
    Snapshotter: every model and optimizer tensor comes back bitwise."""
    model = build(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(batch()).float().sum().backward()
    opt.step()
    opt.zero_grad()
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, backend="cpu")
    snap.boundary(1)
    snap.flush()
    snap.close()
    want = _state(model, opt)
    fresh = build(1)
    opt2 = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    assert _state(fresh, opt2) != want  # the restore has something to do
    snap2 = cudasnap.Snapshotter(fresh, opt2, directory=snap_env.dir, backend="cpu")
    assert snap2.restore_latest() == 2
    got = _state(fresh, opt2)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], k
    snap2.close()
    assert not snap_env.arena_files()


def _refused(snap_env, match: str, build: Callable[[], tuple[torch.nn.Module, object]],
             values: dict[str, object] | None = None, extra: dict[str, object] | None = None
             ) -> None:
    """ONE ConfigError matching ``match`` (at construction, or at the first boundary when
    ``values`` is given), and no arena file of this job."""
    model, opt = build()
    with pytest.raises(ConfigError, match=match) as ei:
        snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, backend="cpu",
                                    extra=extra)
        try:
            snap.boundary(0, **(values or {}))
        finally:
            assert not snap_env.arena_files()
            snap.close()
    assert values is not None or "snap" not in locals()  # refused by the constructor
    assert type(ei.value) is ConfigError
    assert not snap_env.arena_files()


def _linear(seed: int, **buffers: Callable[[], torch.Tensor]) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 2)
    for name, make in buffers.items():
        m.register_buffer(name, make())
    return m


# ------------------------------------------------------------------ meta device
META_JOB = """
import torch, cudasnap
from cudasnap.errors import ConfigError
case, d = {case!r}, {d!r}
m = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
if case == "buffer":
    m.register_buffer("stat", torch.empty(3, device="meta"))  # deferred init left it there
elif case == "model":
    with torch.device("meta"):
        m = torch.nn.Linear(4, 2)
    opt = None
elif case == "optim":
    opt.state[m.weight]["momentum_buffer"] = torch.empty(2, 4, device="meta")
try:
    snap = cudasnap.Snapshotter(m, opt, directory=d, backend="cpu")
    print("CONSTRUCTED", flush=True)
    snap.boundary(0)
    snap.wait()
    snap.flush()
    print("SNAPSHOTTED", flush=True)
except ConfigError as e:
    print("REFUSED", type(e).__name__, e, flush=True)
"""


@pytest.mark.parametrize("case,name,when", [
    ("buffer", "model.stat", "construction"),
    ("model", "model.weight", "construction"),
    ("optim", "optim.state.0.momentum_buffer", "boundary"),
])
@pytest.mark.slow
def test_meta_device_state_is_refused_naming_it(snap_env, case, name, when) -> None:
    """In a subprocess: this segfaulted the copy workers (exit 139) and left the arena."""
    code = textwrap.dedent(META_JOB.format(case=case, d=str(snap_env.dir)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDASNAP_JOB": snap_env.job,
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    assert f"REFUSED ConfigError {name} is on the meta device" in p.stdout, p.stdout
    assert ("CONSTRUCTED" in p.stdout) == (when == "boundary"), p.stdout
    assert "SNAPSHOTTED" not in p.stdout
    assert not snap_env.arena_files()


def test_meta_tensors_in_extra_and_values_are_refused(snap_env) -> None:
    meta = torch.empty(3, device="meta")
    _refused(snap_env, r"^extra\['mt'\] is on the meta device",
             lambda: (_linear(0), None), extra={"mt": meta})
    _refused(snap_env, r"^cannot snapshot host\.values\.mt: the tensor is on the meta device",
             lambda: (_linear(0), None), values={"mt": meta})


# --------------------------------------------------------------------- nested
def _nested(layout: torch.layout) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_refused_naming_them(snap_env, layout) -> None:
    """Was torch's RuntimeError (NestedTensorImpl doesn't support sizes / nested reshape)
    from inside cudasnap at the first boundary (model, extra and values alike)."""
    _refused(snap_env, r"^model\.nt is a NestedTensor",
             lambda: (_linear(0, nt=lambda: _nested(layout)), None))
    _refused(snap_env, r"^extra\['nt'\] is a NestedTensor",
             lambda: (_linear(0), None), extra={"nt": _nested(layout)})
    _refused(snap_env, r"^cannot snapshot host\.values\.nt: the tensor is a NestedTensor",
             lambda: (_linear(0), None), values={"nt": _nested(layout)})
    # inside an extra container: found by the codec at the first boundary, named by its path
    _refused(snap_env, r"^cannot snapshot host\.extra\.box\.state\.nt: the tensor is a NestedT",
             lambda: (_linear(0), None), values={}, extra={"box": {"nt": _nested(layout)}})


# -------------------------------------------------------- another device than the rest
def test_a_tensor_on_another_device_than_the_rest_is_refused(snap_env) -> None:
    """CPU state with one tensor on a device the copy engine cannot read (meta here: the only
    other device a CPU machine has; CUDA mixes: see the gpu tests below)."""
    _refused(snap_env, r"^model\.odd is on the meta device",
             lambda: (_linear(0, odd=lambda: torch.zeros(2, device="meta")), None))


@pytest.mark.gpu
def test_cuda_state_with_the_cpu_backend_is_refused(snap_env) -> None:
    model = _linear(0, odd=lambda: torch.zeros(2, device="cuda"))
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, backend="cpu")
    with pytest.raises(ConfigError, match=r"backend=.cpu. but model\.odd lives on a CUDA device"):
        snap.boundary(0)
    assert not snap_env.arena_files()
    snap.close()


# ------------------------------------------------- zero-size and non-contiguous views
def test_zero_size_tensors_round_trip(snap_env) -> None:
    _round_trip(snap_env, lambda s: _linear(s, empty=lambda: torch.empty(0, 3),
                                            none=lambda: torch.empty(4, 0, 2, dtype=torch.int64),
                                            scalar=lambda: torch.randn(())))


def test_non_contiguous_views_round_trip(snap_env) -> None:
    def build(seed: int) -> torch.nn.Module:
        m = _linear(seed)
        base = torch.randn(4, 6)
        m.register_buffer("transposed", base.t())          # shares `base` with the next two
        m.register_buffer("every_other", base[:, ::2])
        m.register_buffer("offset", base[1:, 2:5])
        m.register_buffer("weight_t", m.weight.detach().t())  # a view of a parameter
        m.register_buffer("expanded", torch.randn(3).expand(4, 3))  # stride 0
        return m

    _round_trip(snap_env, build)


# ------------------------------------------------------------ requires_grad=False
def test_requires_grad_false_buffers_and_frozen_parameters_round_trip(snap_env) -> None:
    def build(seed: int) -> torch.nn.Module:
        m = _linear(seed, stat=lambda: torch.randn(5), count=lambda: torch.randint(9, (2,)))
        m.bias.requires_grad_(False)  # frozen: in the model, not in the optimizer
        return m

    _round_trip(snap_env, build)


# ------------------------------------------------------------------ dtypes
def test_float8_and_bfloat16_round_trip(snap_env) -> None:
    def build(seed: int) -> torch.nn.Module:
        m = _linear(seed, e4m3=lambda: torch.randn(7).to(torch.float8_e4m3fn),
                    e5m2=lambda: torch.randn(2, 3).to(torch.float8_e5m2),
                    e4m3_t=lambda: torch.randn(3, 2).to(torch.float8_e4m3fn).t())
        return m.to(torch.bfloat16)  # parameters and AdamW state in bfloat16; float8 kept

    _round_trip(snap_env, build, batch=lambda: torch.randn(3, 4, dtype=torch.bfloat16))


def test_float8_values_round_trip_through_the_manifest(snap_env) -> None:
    model = _linear(0)
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, backend="cpu")
    a, b = torch.randn(5).to(torch.float8_e4m3fn), torch.randn(2, 2).to(torch.float8_e5m2)
    c = torch.randn(3, dtype=torch.bfloat16)
    snap.boundary(0, a=a, b=b, c=c)
    snap.flush()
    snap.close()
    snap2 = cudasnap.Snapshotter(_linear(1), None, directory=snap_env.dir, backend="cpu")
    assert snap2.restore_latest() == 1
    for k, t in {"a": a, "b": b, "c": c}.items():
        assert _raw(snap2.values[k]) == _raw(t), k
    snap2.close()


def test_an_unsupported_dtype_is_refused_naming_the_tensor(snap_env) -> None:
    _refused(snap_env, r"^model\.half_complex has dtype complex32, which snapshots do not hold",
             lambda: (_linear(0, half_complex=lambda: torch.zeros(2, dtype=torch.complex32)),
                      None))


# ------------------------------------------------------- torchao-style wrapper subclass
class Int8Weight(torch.Tensor):
    """A torchao-style wrapper: int8 data and a scale, flattened for torch.compile/export."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32,
                                                   device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor):
        self.data_i8, self.scale = data, scale

    def __tensor_flatten__(self):
        return ["data_i8", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Weight(inner["data_i8"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # what nn.Parameter(...) needs
            return Int8Weight(args[0].data_i8, args[0].scale)

        def unwrap(x):
            return x.data_i8.float() * x.scale if isinstance(x, Int8Weight) else x

        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def _int8() -> Int8Weight:
    return Int8Weight(torch.randint(-8, 8, (2, 4), dtype=torch.int8), torch.tensor(0.5))


def test_a_torchao_style_wrapper_subclass_in_the_model_restores_bitwise(snap_env) -> None:
    """Issue 45: a traceable subclass (``__tensor_flatten__``) as a buffer and as a parameter
    is snapshotted as its inner tensors and restored into a model built alike (this test
    asserted a refusal before); in host state (``extra``, ``boundary(**values)``), which the
    codec reads through torch, it is still refused naming it."""
    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = _linear(seed, q=_int8)
        m.weight = torch.nn.Parameter(_int8(), requires_grad=False)
        return m

    model = build(0)
    snap = cudasnap.Snapshotter(model, None, directory=snap_env.dir, backend="cpu")
    snap.boundary(1)
    snap.flush()
    snap.close()
    fresh = build(1)
    assert not torch.equal(fresh.q.data_i8, model.q.data_i8)
    snap2 = cudasnap.Snapshotter(fresh, None, directory=snap_env.dir, backend="cpu")
    try:
        assert snap2.restore_latest() == 2
    finally:
        snap2.close()
    for a, b in ((fresh.q, model.q), (fresh.weight, model.weight)):
        assert type(a) is Int8Weight
        assert torch.equal(a.data_i8, b.data_i8) and torch.equal(a.scale, b.scale)
    assert torch.equal(fresh.bias, model.bias)
    _refused(snap_env, r"^extra\['q'\] is a .*Int8Weight, a tensor subclass",
             lambda: (_linear(0), None), extra={"q": _int8()})
    _refused(snap_env, r"^cannot snapshot host\.values\.q: the tensor is a .*Int8Weight",
             lambda: (_linear(0), None), values={"q": _int8()})


def test_an_uninitialized_lazy_parameter_is_refused_naming_it(snap_env) -> None:
    """A lazy module before its first forward (its parameters have no shape yet)."""
    _refused(snap_env, r"^model\.1\.weight is an uninitialized lazy parameter",
             lambda: (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LazyLinear(2)), None))


def test_views_and_odd_dtypes_roll_back_in_place(snap_env) -> None:
    """The in-process rollback writes the same live tensors (an expand()ed one too)."""
    m = _linear(0)
    base, row = torch.randn(4, 6), torch.randn(3)
    m.register_buffer("every_other", base[:, ::2])
    m.register_buffer("expanded", row.expand(4, 3))
    m.register_buffer("e4m3", torch.randn(5).to(torch.float8_e4m3fn))
    snap = cudasnap.Snapshotter(m, None, directory=snap_env.dir, backend="cpu")
    snap.boundary(0)
    snap.wait()
    want = _state(m, None)
    snap.fence()
    with torch.no_grad():
        base.add_(1.0)
        row.add_(1.0)
        m.e4m3.copy_(torch.randn(5).to(torch.float8_e4m3fn))
        m.weight.add_(1.0)
    assert _state(m, None) != want
    assert snap.rollback() == 1
    assert _state(m, None) == want
    snap.close()
    assert not snap_env.arena_files()
