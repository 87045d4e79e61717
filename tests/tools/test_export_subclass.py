"""Issue 45 item 1, the exports: a snapshot of torchao's low-bit optimizer state (a tensor
subclass held as its inner tensors, cudasnap.core.wrapped) exported as each target holds
such a value (cudasnap.tools.wrapped_entries): ``--to dcp`` as DCP saves it (the object; a
``dcp.load`` + ``set_state_dict`` into a new torchao optimizer gives back the same codes),
``--to torch`` the subclass itself (``opt.load_state_dict`` takes it back bitwise),
``--to safetensors --optimizer`` its dequantized values. Sharded (FSDP2):
tests/distributed/test_subclass_fsdp2.py."""
from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from cudasnap.snapshotter import Snapshotter
from cudasnap.tools import cli

ao = pytest.importorskip("torchao.optim", reason="torchao is not installed "
                         "(requirements-extras.txt)")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Linear(96, 8))


def _train(m: torch.nn.Module, o: torch.optim.Optimizer, steps: int,
           snap: Snapshotter | None = None) -> None:
    for i in range(steps):
        m(torch.randn(4, 128, generator=torch.Generator().manual_seed(i))).sum().backward()
        o.step()
        o.zero_grad(set_to_none=True)
        if snap is not None:
            snap.boundary(i)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("subexp")
    m = _model()
    o = ao.AdamW4bit(m.parameters(), lr=1e-2)
    snap = Snapshotter(m, o, directory=tmp / "ckpt", health=False, copy_threads=1,
                       job=f"subexp-{uuid.uuid4().hex[:8]}")
    try:
        _train(m, o, 2, snap)
        snap.flush()
    finally:
        snap.close()
    return {"tmp": tmp, "ckpt": tmp / "ckpt", "model": m, "opt": o}


def _codes(o: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    v = o.state[p]["exp_avg"]
    return [v.codes, v.scale, v.qmap]


def test_to_torch_holds_the_subclass_value(snapshot: dict[str, Any]) -> None:
    out = snapshot["tmp"] / "t.pt"
    assert cli.main(["export", str(snapshot["ckpt"]), "--to", "torch", str(out)]) == 0
    d = torch.load(out, weights_only=False)
    m2 = _model()
    o2 = ao.AdamW4bit(m2.parameters(), lr=1e-2)
    m2.load_state_dict(d["model"])
    o2.load_state_dict(d["optimizer"])
    w, w2 = snapshot["model"][0].weight, m2[0].weight
    assert type(o2.state[w2]["exp_avg"]).__name__ == "OptimState4bit"
    for a, b in zip(_codes(snapshot["opt"], w), _codes(o2, w2)):
        assert torch.equal(a, b)


def test_to_dcp_loads_into_a_new_torchao_optimizer(snapshot: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = snapshot["tmp"] / "dcp"
    assert cli.main(["export", str(snapshot["ckpt"]), "--to", "dcp", str(out)]) == 0
    m2 = _model()
    o2 = ao.AdamW4bit(m2.parameters(), lr=1e-2)
    _train(m2, o2, 1)  # torchao makes its state at the first step
    msd, osd = get_state_dict(m2, o2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    w, w2 = snapshot["model"][0].weight, m2[0].weight
    assert torch.equal(w, w2)
    for a, b in zip(_codes(snapshot["opt"], w), _codes(o2, w2)):
        assert torch.equal(a, b)
    md = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert list(md["optim.state.0.weight.exp_avg"].size) == [96, 128]  # the value, not codes
    assert not any(k.endswith((".codes", ".qmap")) for k in md)


def test_to_safetensors_writes_the_plain_values(snapshot: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    out = snapshot["tmp"] / "st"
    assert cli.main(["export", str(snapshot["ckpt"]), "--to", "safetensors", "--optimizer",
                     str(out)]) == 0
    files = {p.name: p for p in snapshot["tmp"].rglob("optimizer.safetensors")}
    got = load_file(str(files["optimizer.safetensors"]))
    v = snapshot["opt"].state[snapshot["model"][0].weight]["exp_avg"]
    want = torch.empty(v.shape)
    want.copy_(v)  # torchao's own dequantization
    assert torch.equal(got["state.0.exp_avg"], want)
    assert not any(k.endswith(".codes") for k in got)
