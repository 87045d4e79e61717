"""The Snapshotter warms oneMKL's VML functions once, before the training loop's first
float unary op (pytorch/pytorch#188792: a process's first VML call made on several
threads at once can run a low-accuracy kernel on one thread's chunk, so two runs of
the same script differ from step 0). The race itself cannot be triggered on demand;
these tests pin what cudasnap does about it: the warm-up runs at construction, once,
on the constructing thread, without CUDA, and every op it names exists in this torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from cudasnap.core import vml_warmup

REPO = Path(__file__).resolve().parents[2]


def test_every_warmed_op_is_a_torch_float_op() -> None:
    x = torch.full((3,), 0.25)
    for name in vml_warmup.OPS:
        y = getattr(torch, name)(x)
        assert y.dtype == torch.float32 and y.shape == x.shape, name


def test_the_snapshotter_warms_vml_once_at_construction_without_cuda(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import torch, cudasnap
        from cudasnap.core import vml_warmup
        assert not vml_warmup.warmed()
        m = torch.nn.Linear(4, 4); opt = torch.optim.AdamW(m.parameters())
        snap = cudasnap.Snapshotter(m, opt, directory={str(tmp_path / 'ckpt')!r})
        assert vml_warmup.warmed() == torch.backends.mkl.is_available()
        assert vml_warmup.warm() is False  # once per process
        cudasnap.Snapshotter(torch.nn.Linear(2, 2), directory={str(tmp_path / 'ckpt2')!r}).close()
        assert not torch.cuda.is_initialized()
        snap.close()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, text=True, capture_output=True,
                       timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
