"""Lightning and Hugging Face integrations: a run killed with SIGKILL and resumed
under the callback ends with bit-identical weights to an uninterrupted run.

Each scenario runs this file as a child process (``python test_integrations.py
lightning|hf MODE ...``): ``ref`` trains without cudasnap, ``crash`` trains under
the callback and SIGKILLs itself right after the snapshot of a given global step
is COMPLETE (no close, no flush: the shared-memory slot is what survives), and
``resume`` is a fresh process running the same script. Tiny models, synthetic
data, CPU only, no downloads (HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


def _have(*mods: str) -> str | None:
    for m in mods:
        try:
            importlib.import_module(m)
            return m
        except ImportError:
            continue
    return None


def _need_lightning() -> None:
    if _have("lightning.pytorch") is None:  # else the standalone package will do
        pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed "
                            "(neither lightning nor pytorch_lightning; see "
                            "requirements-extras.txt)")


# ======================================================================= children
def _emit(tag: str, out: str | None, arrays: dict | None, info: dict) -> None:
    import numpy as np

    if out is not None:
        np.savez(out, **arrays)
    print(f"{tag} " + json.dumps(info), flush=True)


def _hook_split(mod, dim: int, parts: int) -> None:
    """Makes ``mod``'s state_dict hold copies of its weight in ``parts`` pieces (as
    torchtitan's fused q/k/v hook does) and a load pre-hook fuse them again (issue 32: a
    snapshot of those copies resumed silently wrong)."""
    import torch

    def split(m, sd, prefix, _):
        w = sd.pop(prefix + "weight")
        for i, piece in enumerate(w.chunk(parts, dim=dim)):
            sd[f"{prefix}weight_{i}"] = piece.clone()

    def fuse(sd, prefix, *_):
        if prefix + "weight_0" in sd:
            sd[prefix + "weight"] = torch.cat([sd.pop(f"{prefix}weight_{i}")
                                               for i in range(parts)], dim=dim)

    mod._register_state_dict_hook(split)
    mod._register_load_state_dict_pre_hook(fuse)


def _lightning_fit(a: argparse.Namespace, mode: str, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from cudasnap.integrations.lightning import CudaSnapCallback, ResumableDataLoader, pl

    pl.seed_everything(0, verbose=False)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                           torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                           torch.nn.Linear(16, 1))
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sch = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    loader = ResumableDataLoader(ds, batch_size=4, shuffle=True)  # 10 batches per epoch
    model = Tiny()
    if a.hooked:
        _hook_split(model.net[0], 0, 2)
    callbacks: list = []
    snap_cb = None
    if mode != "ref":
        snap_cb = CudaSnapCallback(directory=a.dir, copy_threads=1)
        callbacks.append(snap_cb)
    if mode != "ref" and (a.kill_at >= 0 or a.raise_at >= 0):
        class Killer(pl.Callback):
            def on_train_batch_end(self, trainer, *_args):
                if trainer.global_step in (a.kill_at, a.raise_at):
                    snap_cb.snapshotter.wait()  # the snapshot of this step is COMPLETE
                if trainer.global_step == a.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if trainer.global_step == a.raise_at:
                    raise RuntimeError("injected failure")

        callbacks.append(Killer())
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=a.root, callbacks=callbacks)
    trainer.fit(model, loader)
    st = snap_cb.stats() if snap_cb else None
    _emit("RESULT", out, {k: v.detach().numpy() for k, v in model.state_dict().items()},
          {"restored": snap_cb.restored_step if snap_cb else None, "calls": model.calls,
           "global_step": trainer.global_step, "epoch": trainer.current_epoch,
           "lr": trainer.optimizers[0].param_groups[0]["lr"],
           "source": (st["restore"] or {}).get("source") if st else None,
           "selfcheck": _loader_selfcheck(ResumableDataLoader, ds) if mode == "resume" else None})


def _loader_selfcheck(cls: type, ds) -> dict:
    """ResumableDataLoader alone: a restored position continues with the same batches + RNG."""
    import torch

    torch.manual_seed(5)
    a = cls(ds, batch_size=4, shuffle=True)
    it = iter(a)
    head = [next(it) for _ in range(3)]
    state = a.state_dict()
    rest = [b for b in it]
    torch.manual_seed(6)  # a different process state ...
    b = cls(ds, batch_size=4, shuffle=True)
    b.load_state_dict(state)
    before = torch.get_rng_state()
    got = list(iter(b))
    same_rng = bool(torch.equal(before, torch.get_rng_state()))
    ok = len(got) == len(rest) and all(torch.equal(x[0], y[0]) for x, y in zip(got, rest))
    return {"yielded": state["yielded"], "same_batches": ok, "rng_untouched": same_rng,
            "head": len(head)}


def _hf_fit(a: argparse.Namespace, mode: str, out: str, resume: bool = True) -> dict:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from cudasnap.integrations.hf import CudaSnapTrainerCallback

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    model = GPT2LMHeadModel(cfg)  # randomly initialised from a config: no download
    if a.hooked:
        _hook_split(model.transformer.h[0].attn.c_attn, 1, 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (40, 16), generator=g)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = TrainingArguments(output_dir=a.root, per_device_train_batch_size=4, num_train_epochs=3,
                             learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=3,
                             logging_steps=1000, save_strategy="no", eval_strategy="no",
                             report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    callbacks: list = []
    snap_cb = None
    if mode != "ref":
        snap_cb = CudaSnapTrainerCallback(directory=a.dir, copy_threads=1)
        callbacks.append(snap_cb)
    calls = {"n": 0, "lr": []}

    class Count(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            calls["n"] += 1
            calls["lr"].append(optimizer.param_groups[0]["lr"])
            if mode != "ref" and state.global_step == a.kill_at:
                snap_cb.snapshotter.wait()  # the snapshot of this step is COMPLETE
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks.append(Count())
    trainer = Trainer(model=model, args=args, train_dataset=DS(), callbacks=callbacks)
    ckpt = snap_cb.resume_checkpoint() if snap_cb and resume else None
    if mode == "crash":
        print("PRE " + json.dumps({"resume_checkpoint": ckpt}), flush=True)
    trainer.train(resume_from_checkpoint=ckpt)
    st = snap_cb.stats() if snap_cb else None
    info = {"restored": snap_cb.restored_step if snap_cb else None, "calls": calls["n"],
            "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "lr": calls["lr"][-1], "source": (st["restore"] or {}).get("source") if st else None}
    if out:
        _emit("RESULT", out, {k: v.detach().numpy() for k, v in model.state_dict().items()}, info)
    return info


def _hf_not_told_to_resume(a: argparse.Namespace) -> str:
    """train() without resume_from_checkpoint on a directory holding a snapshot: a clear error."""
    from cudasnap.errors import SnapshotError

    try:
        _hf_fit(a, "resume", "", resume=False)
    except SnapshotError as e:
        return str(e)
    return "no error"


def _child_main(argv: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("framework", choices=["lightning", "hf"])
    ap.add_argument("mode", choices=["crash", "resume"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref-out", default=None, help="first run uninterrupted, without cudasnap")
    ap.add_argument("--kill-at", type=int, default=-1, help="SIGKILL after this global step")
    ap.add_argument("--raise-at", type=int, default=-1, help="raise after this global step")
    ap.add_argument("--hooked", action="store_true", help="a state_dict hook returns copies")
    a = ap.parse_args(argv)
    if a.framework == "lightning":
        if a.ref_out:
            _lightning_fit(a, "ref", a.ref_out)
        try:
            _lightning_fit(a, a.mode, a.out)
        except RuntimeError as e:
            if "injected failure" not in str(e):
                raise
            # The run failed (on_exception kept the arena): a fresh Trainer, model and
            # callback in this process resume from it.
            a.raise_at = -1
            _lightning_fit(a, a.mode, a.out)
    else:
        if a.ref_out:
            _hf_fit(a, "ref", a.ref_out)
        _hf_fit(a, a.mode, a.out)
        if a.mode == "resume":
            print("CHECK " + json.dumps({"unresumed": _hf_not_told_to_resume(a)}), flush=True)


# ========================================================================== tests
def _run(tmp: Path, framework: str, mode: str, *extra: str, killed: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDASNAP_HEALTH", None)  # the callbacks' default: health monitor on
    cmd = [sys.executable, str(HERE), framework, mode, "--dir", str(tmp / "ckpt"),
           "--root", str(tmp / "root"), "--out", str(tmp / f"{mode}.npz"), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    want = -signal.SIGKILL if killed else 0
    assert p.returncode == want, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    lines: dict = {}
    for ln in p.stdout.splitlines():
        tag, _, rest = ln.partition(" ")
        if tag in ("RESULT", "PRE", "CHECK"):
            lines[tag] = json.loads(rest)
    return lines


def _load(path: Path) -> dict:
    import numpy as np

    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _differing(a: dict, b: dict) -> list[str]:
    import numpy as np

    assert a.keys() == b.keys()
    return [k for k in a if not np.array_equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "state-dict-hook"])
def test_lightning_kill_resume_is_bitwise(snap_env, hooked: bool) -> None:
    """SIGKILLed mid-epoch (step 13), resumed in a new process; that run fails with an
    exception at an epoch end (step 20) and is resumed by a fresh Trainer. ``hooked``: the
    model's state_dict holds copies of a weight (a split hook)."""
    _need_lightning()
    tmp = snap_env.tmp
    ref_npz = tmp / "ref.npz"
    hk = ("--hooked",) if hooked else ()
    _run(tmp, "lightning", "crash", "--kill-at", "13", "--ref-out", str(ref_npz), *hk,
         killed=True)
    assert ref_npz.exists()
    r = _run(tmp, "lightning", "resume", "--raise-at", "20", *hk)["RESULT"]
    # Restored from the shared-memory slot the failed run left, at the step after it.
    assert r["source"] == "shm" and r["restored"] == 20
    assert r["calls"] == 30 - 20  # exactly the remaining optimizer steps were trained
    assert r["global_step"] == 30 and r["epoch"] == 3
    assert r["lr"] == 1e-2 * 0.5 ** (30 // 7)  # the StepLR scheduler was restored
    assert _differing(_load(tmp / "resume.npz"), _load(ref_npz)) == [], \
        "weights differ from the uninterrupted run"
    sc = r["selfcheck"]
    assert sc == {"yielded": 3, "same_batches": True, "rng_untouched": True, "head": 3}
    # The exception was a trigger: the guard flushed step 20 (index 19) to disk as well.
    assert (tmp / "ckpt" / "step-00000019" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "state-dict-hook"])
def test_hf_kill_resume_is_bitwise(snap_env, hooked: bool) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed "
                        "(see requirements-extras.txt)")
    pytest.importorskip("accelerate", reason="accelerate (needed by transformers.Trainer) "
                        "is not installed")
    tmp = snap_env.tmp
    ref_npz = tmp / "ref.npz"
    hk = ("--hooked",) if hooked else ()
    pre = _run(tmp, "hf", "crash", "--kill-at", "13", "--ref-out", str(ref_npz), *hk,
               killed=True)
    assert pre["PRE"] == {"resume_checkpoint": None}  # a fresh directory: nothing to resume
    out = _run(tmp, "hf", "resume", *hk)
    r = out["RESULT"]
    assert r["source"] == "shm" and r["restored"] == 13
    assert r["calls"] == 30 - 13 and r["global_step"] == 30 and r["epoch"] == 3.0
    assert _differing(_load(tmp / "resume.npz"), _load(ref_npz)) == [], \
        "weights differ from the uninterrupted run"
    # The directory now holds the final snapshot (flushed at train end): a train() that is
    # not told to resume is refused instead of silently training from step 0 again.
    assert "not told to resume" in out["CHECK"]["unresumed"]


def test_integrations_import_lazily() -> None:
    """``import cudasnap.integrations`` imports neither framework."""
    code = ("import sys, cudasnap.integrations as i; "
            "assert 'lightning' not in sys.modules and 'transformers' not in sys.modules; "
            "assert sorted(i.__all__) == ['CudaSnapCallback', 'CudaSnapTrainerCallback', "
            "'ResumableDataLoader']")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr


if __name__ == "__main__":
    _child_main(sys.argv[1:])
