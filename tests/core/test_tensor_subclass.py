"""Tensor subclasses without storage of their own that do not say where their bytes are (no
``__tensor_flatten__``) are refused with a clear error at construction: copying their
wrapper's data_ptr crashed the copy workers (traceable ones are snapshotted as their inner
tensors: test_subclass_state.py). DTensor (FSDP2,
tensor parallel) is the exception: its local shard is snapshotted (cudasnap.core.sharded;
multi-rank tests in tests/distributed/test_sharded.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cudasnap.core.live_tensor import check_plain_tensor
from cudasnap.core.state import TrainingState
from cudasnap.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_plain_tensors_and_parameters_pass():
    check_plain_tensor("t", torch.zeros(3))
    check_plain_tensor("p", torch.nn.Parameter(torch.zeros(3)))


def test_a_dispatch_wrapper_subclass_is_refused():
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    m = torch.nn.Linear(2, 2)
    m.register_buffer("odd", Wrapper(torch.zeros(2)))
    with pytest.raises(ConfigError, match=r"model\.odd is a .*Wrapper, a __torch_dispatch__ "
                                          r"tensor subclass without __tensor_flatten__"):
        TrainingState(m, None)


@pytest.mark.slow
def test_fully_shard_model_snapshots_its_local_shards(snap_env):
    """FSDP2 on a one-rank CPU mesh (gloo): this segfaulted the copy workers; now its local
    shards are snapshotted and a rollback puts them back."""
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import cudasnap
        dist.init_process_group("gloo", init_method="file://{snap_env.tmp / 'pg'}", rank=0,
                                world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        snap = cudasnap.Snapshotter(model, opt, directory={str(snap_env.dir)!r}, backend="cpu")
        def step(i):
            model(torch.randn(3, 8)).sum().backward(); opt.step(); opt.zero_grad()
            snap.boundary(i)
        for i in range(3):
            step(i)
        snap.wait()
        saved = [t.full_tensor().clone() for t in model.state_dict().values()]
        snap.fence()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # a bad update, never snapshotted
        at = snap.rollback()
        same = all(torch.equal(t.full_tensor(), s) for t, s in zip(model.state_dict().values(), saved))
        print("RESUME_AT", at, same)
        snap.close()
        dist.destroy_process_group()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDASNAP_JOB": snap_env.job}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=env)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "RESUME_AT 3 True" in p.stdout, p.stdout
