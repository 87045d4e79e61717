"""A torchdata ``StatefulDataLoader`` with worker processes in ``extra`` resumes at the
exact next batch after ``kill -9`` (issue 22 item 6).

The loader (map-style dataset, ``shuffle=True`` with a seeded generator, ``num_workers=2``,
batch size 8) is snapshotted as host state through its ``state_dict()``: with workers it
holds a nested dict of ints/None/str keys plus the shuffle generator's state as a uint8
tensor, all of which the no-pickle codec encodes (the codec round trip is checked here
too). The snapshot is taken at ``boundary(step)`` after the step's batch was consumed,
while the workers have prefetched batches beyond it: the loader's state must be the
position of the next batch, not of the prefetched ones.

Run A trains N steps uninterrupted; run B trains with a Snapshotter, SIGKILLs itself after
a boundary's snapshot completed, and a fresh process restores with ``restore_latest()``
and trains to N. The batches of the resumed steps and the final model/optimizer bytes
equal run A's, bit for bit. One case resumes mid-epoch and crosses an epoch boundary after
the resume, one is killed at the last batch of an epoch.

Child processes run this file as a script: ``python tests/integrations/test_stateful_dataloader.py
MODE ...``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO), str(HERE.parent)):  # the repository; tests/ (helpers) when run as a child
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.children import last_json, run_script  # noqa: E402

pytest.importorskip("torchdata.stateful_dataloader")

# torchdata 0.11 calls the deprecated torch.set_vital in every StatefulDataLoader.__init__.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

N_STEPS = 12
BATCH = 8


class Squares(torch.utils.data.Dataset):
    """Deterministic map-style dataset: sample i is (features, target, i)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.arange(6, dtype=torch.float32) * 0.01 + i * 0.1
        return torch.sin(x), torch.cos(x[:2]) * i * 0.01, i


def build(n_samples: int) -> tuple[Any, Any, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator()
    gen.manual_seed(1234)
    loader = StatefulDataLoader(Squares(n_samples), batch_size=BATCH, shuffle=True,
                                generator=gen, num_workers=2)
    return model, opt, loader


def fingerprint(batch: Any) -> str:
    h = hashlib.sha256()
    for t in batch:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def state_digest(model: Any, opt: Any) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(torch.as_tensor(v).contiguous().numpy().tobytes())
    return h.hexdigest()


def train(model: Any, opt: Any, loader: Any, start: int, stop: int,
          on_boundary: Any = None) -> dict[str, Any]:
    """Steps start..stop-1 over the loader (epoch after epoch; a restored loader resumes
    mid-epoch); returns the batch fingerprints and sample ids per step."""
    fps: dict[str, str] = {}
    ids: dict[str, list[int]] = {}
    step = start
    while step < stop:
        for batch in loader:
            x, y, idx = batch
            fps[str(step)] = fingerprint(batch)
            ids[str(step)] = idx.tolist()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if on_boundary is not None:
                on_boundary(step)
            step += 1
            if step >= stop:
                break
    return {"fps": fps, "ids": ids}


# ------------------------------------------------------------------ child modes
def child_plain(a: argparse.Namespace) -> None:
    """The uninterrupted reference runs, one per dataset size in ``a.sizes``."""
    outs = {}
    for n in a.sizes:
        model, opt, loader = build(n)
        out = train(model, opt, loader, 0, N_STEPS)
        out["state"] = state_digest(model, opt)
        outs[str(n)] = out
    print(json.dumps(outs), flush=True)


def child_crash(a: argparse.Namespace) -> None:
    import cudasnap

    model, opt, loader = build(a.n)
    snap = cudasnap.Snapshotter(model, opt, directory=a.dir, job=a.job, backend="cpu",
                                health=False, extra={"data": loader})
    assert snap.restore_latest() == 0

    def boundary(step: int) -> None:
        snap.boundary(step)
        if step == a.kill_after:
            snap.wait()
            print(json.dumps({"killed_after": step}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    train(model, opt, loader, 0, N_STEPS, boundary)
    raise AssertionError("not killed")


def child_resume(a: argparse.Namespace) -> None:
    import cudasnap

    model, opt, loader = build(a.n)
    # A different shuffle seed: the restored loader state must bring back the order.
    loader.generator.manual_seed(99)
    snap = cudasnap.Snapshotter(model, opt, directory=a.dir, job=a.job, backend="cpu",
                                health=False, extra={"data": loader})
    start = snap.restore_latest()
    out = train(model, opt, loader, start, N_STEPS)
    out["start"] = start
    out["state"] = state_digest(model, opt)
    snap.close()
    print(json.dumps(out), flush=True)


def run_child(mode: str, *args: Any, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_script(__file__, mode, *args, timeout=timeout)


# ------------------------------------------------------------------ tests
def test_loader_state_with_workers_round_trips_through_the_codec() -> None:
    """The state_dict of a loader with workers, mid-epoch (prefetch running ahead), survives
    encode -> JSON -> decode and a fresh loader with another seed continues identically."""
    from cudasnap.format.codec import decode, encode

    _, _, loader = build(200)
    it = iter(loader)
    for _ in range(5):
        next(it)
    sd = loader.state_dict()
    back = decode(json.loads(json.dumps(encode(sd))))
    snap_ = back["_snapshot"]
    assert snap_["_snapshot_step"] == 5  # the next batch, not the prefetched ones
    gen_state = snap_["_main_snapshot"]["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert isinstance(gen_state, torch.Tensor) and gen_state.dtype == torch.uint8
    _, _, fresh = build(200)
    fresh.generator.manual_seed(99)
    fresh.load_state_dict(back)
    it2 = iter(fresh)
    for _ in range(4):
        assert fingerprint(next(it)) == fingerprint(next(it2))
    del it, it2


SIZES = (240, 72)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Run A for every dataset size (one child process)."""
    ref = run_child("plain", "--sizes", *SIZES)
    assert ref.returncode == 0, ref.stderr
    return last_json(ref)


@pytest.mark.slow
@pytest.mark.parametrize(("n_samples", "kill_after"), [
    (240, 5),  # 30 batches an epoch: mid-epoch
    (72, 5),  # 9 batches an epoch: resumed mid-epoch, crosses into epoch 1 after the resume
    (72, 8),  # killed right after the last batch of epoch 0
], ids=["mid-epoch", "resume-crosses-epoch", "kill-at-epoch-end"])
def test_resume_after_kill9_sees_the_same_batches(snap_env, reference: dict[str, Any],
                                                  n_samples: int, kill_after: int) -> None:
    a = reference[str(n_samples)]
    assert len(a["fps"]) == N_STEPS
    if n_samples == 72:  # the reference run does cross the epoch
        assert sorted(sum((a["ids"][str(s)] for s in range(9)), [])) == list(range(72))

    common = ("--n", n_samples, "--dir", snap_env.dir, "--job", snap_env.job)
    crash = run_child("crash", *common, "--kill-after", kill_after)
    assert crash.returncode == -signal.SIGKILL, (crash.returncode, crash.stdout, crash.stderr)
    assert last_json(crash) == {"killed_after": kill_after}

    res = run_child("resume", *common)
    assert res.returncode == 0, res.stderr
    b = last_json(res)
    assert b["start"] == kill_after + 1
    resumed = [str(s) for s in range(kill_after + 1, N_STEPS)]
    assert list(b["fps"]) == resumed
    assert [b["ids"][s] for s in resumed] == [a["ids"][s] for s in resumed]
    assert [b["fps"][s] for s in resumed] == [a["fps"][s] for s in resumed]
    assert b["state"] == a["state"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["plain", "crash", "resume"])
    p.add_argument("--n", type=int)
    p.add_argument("--sizes", type=int, nargs="+")
    p.add_argument("--dir")
    p.add_argument("--job")
    p.add_argument("--kill-after", type=int)
    a = p.parse_args()
    torch.set_num_threads(1)
    {"plain": child_plain, "crash": child_crash, "resume": child_resume}[a.mode](a)


if __name__ == "__main__":
    main()
