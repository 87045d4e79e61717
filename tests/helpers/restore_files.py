"""Snapshot files and training states shared by the restore tests
(tests/core/test_restore_fused.py, tests/core/test_restore_read_ahead.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

import cudasnap
from cudasnap.core import copy_back
from helpers import parts

CH = 4096  # the smallest chunk a manifest allows: many chunks in a small file


def data_file(C, tmp_path: Path, nbytes: int, chunk: int = CH, seed: int = 0) -> tuple[Path, np.ndarray,
                                                                                     list[int]]:
    """A file of ``nbytes`` random bytes written by the flusher; (path, bytes, chunk CRCs)."""
    src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / f"data-{seed}-{nbytes}.bin"
    st = C.write_buffer_file(src.ctypes.data, nbytes, chunk, str(path), 2, 1 << 20, False)
    return path, src, st["crc32c"]


def entry(shape: list[int], dtype: str, offset: int) -> dict:
    from cudasnap.format import manifest as M

    stride = copy_back.contiguous_strides(shape)
    return {"name": f"t{offset}", "group": "model:model", "dtype": dtype, "shape": shape,
            "stride": stride, "storage_offset": 0, "offset": offset,
            "nbytes": M.span_bytes(shape, stride, parts.itemsize(dtype)), "phase": 1}


class Odd(nn.Module):
    """Odd dtypes, a zero-size parameter, a non-contiguous and an expanded buffer, tied
    weights, and ``n`` more small parameters."""

    def __init__(self, n: int = 0) -> None:
        super().__init__()
        self.a = nn.Linear(33, 17)
        self.b = nn.Linear(17, 33)
        self.b.weight = nn.Parameter(self.a.weight.detach().t().clone())
        self.tied = self.a  # the same module twice: tied parameters
        self.h16 = nn.Parameter(torch.randn(129).half())
        self.bf = nn.Parameter(torch.randn(3, 65).bfloat16())
        self.f64 = nn.Parameter(torch.randn(77, dtype=torch.float64))
        self.cplx = nn.Parameter(torch.randn(11, dtype=torch.complex64))
        self.empty = nn.Parameter(torch.zeros(0, 5))
        self.register_buffer("i8", torch.randint(-100, 100, (301,), dtype=torch.int8))
        self.register_buffer("u8", torch.randint(0, 255, (5, 7), dtype=torch.uint8))
        self.register_buffer("flags", torch.rand(97) > 0.5)
        self.register_buffer("i64", torch.randint(0, 10**12, (13,)))
        self.register_buffer("nc", torch.randn(9, 14).t())  # non-contiguous
        self.register_buffer("ex", torch.randn(6, 1).expand(6, 8))  # expanded (stride 0)
        self.more = nn.ParameterList([nn.Parameter(torch.randn(5 + i % 7)) for i in range(n)])


def trained(n: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Odd(n)
    params = [p for p in m.parameters() if p.is_floating_point() or p.is_complex()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return m, opt


def state_of(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert bits(a[k]) == bits(b[k]), k


def snapshot_to_disk(snap_env, n: int, steps: int = 1) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """``steps`` snapshots on disk (the arena removed); the state of the last one."""
    m, opt = trained(n, seed=0)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, chunk_bytes=CH, keep=steps + 1)
    dirs = []
    try:
        snap.arena_ready(60)
        for step in range(steps):
            if step:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad = torch.randn_like(p)
                opt.step()
            snap.boundary(step)
            assert snap.wait(60)
            dirs.append(Path(snap.flush()))
        want = state_of(m, opt)
    finally:
        snap.close(flush=False)
    return want, dirs


def restore_fresh(snap_env, n: int, job: str, fresh_optimizer: bool = False
             ) -> tuple[dict[str, torch.Tensor], int, cudasnap.Snapshotter]:
    m, opt = trained(n, seed=1)  # other values: the restore must overwrite them all
    if fresh_optimizer:
        params = [p for p in m.parameters() if p.is_floating_point() or p.is_complex()]
        opt = torch.optim.AdamW(params, lr=1e-2)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, chunk_bytes=CH,
                                job=snap_env.sub_job(job))
    try:
        got = snap.restore_latest()
        return state_of(m, opt), got, snap
    finally:
        snap.close(flush=False)
