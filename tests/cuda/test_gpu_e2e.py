"""End-to-end tests of the Snapshotter on a CUDA model (small GPT-like net + BatchNorm, AdamW).

Without a GPU every test here skips with "needs a CUDA device" (tests/conftest.py).

* snapshot bytes == a synchronous ``clone().cpu()`` of the state taken at the same
  boundary, while the loop keeps writing the state (optimizer steps, BatchNorm buffers in
  the forward) as early as the fences allow; the copy is delayed behind a GPU sleep so a
  missing fence would show as a mismatch. Read straight from the shm slot through ``_C``.
* ``rollback()`` restores bit for bit, into the same live addresses.
* ``kill -9`` of a child after N steps leaves a COMPLETE slot a new process restores.
* the same checks with ``expandable_segments`` on and off (fresh processes).
* ``coverage()`` reports an EMA copy of the model nobody registered.
* a flushed CUDA snapshot restores into a CPU copy of the model.
* the state growing after the first snapshot (an optimizer whose state appears at its
  first step and that cudasnap cannot count ahead) regrows the arena exactly once, on
  CUDA and, unmarked (it runs everywhere), on the CPU.

The state (~60 MB, x 3 slots) is over CUDASNAP_ARENA_SYNC_MAX_BYTES: its staging arena
is made in the background and boundaries before it is ready are skipped, so every
Snapshotter here waits for it (``make_snap``: ``arena_ready()``) before its first boundary.

Child processes run this file as a script: ``python tests/cuda/test_gpu_e2e.py MODE ...``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO), str(HERE.parent)):  # the repository; tests/ (helpers) when run as a child
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import parts  # noqa: E402
from helpers.children import last_json, run_script  # noqa: E402
from helpers.slots import read_slot  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

gpu = pytest.mark.gpu  # on every test that needs a CUDA device (all but the CPU regrowth)
ARENA_READY_S = 120

SHM = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 16384, 256, 2, 4, 64, 8  # ~60 MB of state
# A host function sleeping this long runs on the COPY stream before each snapshot's copies
# (CudaCopyEngine.set_test_copy_delay_us): the compute stream runs the next step's forward
# and optimizer step at once, so a missing phase-0 or phase-1 fence corrupts the slot every
# time. (A sleep on the compute stream would delay the racing writes as well: vacuous.)
COPY_DELAY_US = 20_000


# ------------------------------------------------------------------ the model
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-like (tied embedding) plus a BatchNorm, whose buffers the forward writes."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        B, T, C = x.shape
        x = self.norm(x.reshape(B * T, C)).reshape(B, T, C)
        return self.head(x)


class LazyMomentum(torch.optim.Optimizer):
    """SGD with momentum whose buffers appear at its first step. Not a torch.optim class,
    so cudasnap cannot count its state before it exists (core/arena_preparer.py
    estimate_state_bytes pre-counts Adam(W)'s moments and SGD's buffer): the state grows
    at the first step and the staging arena must regrow once."""

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = p.grad.detach().clone()
                else:
                    st["momentum_buffer"].mul_(g["momentum"]).add_(p.grad)
                p.add_(st["momentum_buffer"], alpha=-g["lr"])


def build(seed: int = 0, device: str = "cuda", fused: bool = False,
          lazy: bool = False) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = TinyGPT().to(device)
    if lazy:
        return model, LazyMomentum(model.parameters())
    kw = {"fused": True} if fused else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)
    return model, opt


def batch(i: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x.to(device), y.to(device)


def train_step(model: nn.Module, opt: Any, i: int, device: str = "cuda") -> None:
    x, y = batch(i, device)
    loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def accept_fallback(reason: str | None) -> bool:
    """True when the shared-memory arena could not be page-locked (gVisor and some VMs
    refuse cudaHostRegister of a MAP_SHARED /dev/shm mapping; issue 21 item 10): cudasnap
    then uses a process-private pinned arena. Allowed, and reported as a warning (in
    pytest's summary) with the reason; the caller skips what needs the shared arena."""
    if not reason:
        return False
    msg = f"staging arena is process-private (cudaHostRegister refused): {reason}"
    print(msg)
    warnings.warn(msg, stacklevel=2)
    return True


def make_snap(model: nn.Module, opt: Any, directory: Path, job: str, **kw: Any) -> Any:
    """A Snapshotter whose staging arena is ready: the state is over
    CUDASNAP_ARENA_SYNC_MAX_BYTES, so the arena is made in the background and a boundary
    before it is ready would be skipped (and the keeper's arena still None)."""
    import cudasnap

    snap = cudasnap.Snapshotter(model, opt, directory=directory, job=job, health=False, **kw)
    assert snap.arena_ready(ARENA_READY_S), f"staging arena not ready in {ARENA_READY_S} s"
    return snap


# ------------------------------------------------------------------ state helpers
def live_state(snap: Any) -> dict[str, torch.Tensor]:
    """name -> CPU copy of every tensor the Snapshotter snapshots (synchronous)."""
    return {lt.name: lt.tensor.detach().clone().cpu() for lt in snap.state.live_tensors()}


def state_ptrs(snap: Any) -> dict[str, int]:
    return {lt.name: lt.tensor.data_ptr() for lt in snap.state.live_tensors()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def diff_names(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes differ (or that are missing on either side)."""
    bad = sorted(set(got) ^ set(want))
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.dtype != torch.uint8:
            a = as_bytes(a)
        if b.dtype != torch.uint8:
            b = as_bytes(b)
        if not torch.equal(a, b):
            bad.append(k)
    return bad


def check_snapshots_equal_clone(snap: Any, model: nn.Module, opt: Any, steps: int,
                                start: int = 0) -> int:
    """Trains ``steps`` steps with a boundary each; checks every slot against the clone.

    Per step: train (fenced writes of the previous copy's state), clone().cpu() the state,
    boundary(): the copy stream sleeps (COPY_DELAY_US) before copying while the compute
    stream goes on to the next step's forward (BatchNorm buffers: phase-0 fence) and
    optimizer step (phase-1 fence); only then does the host wait and read the slot.
    """
    expected: dict[int, dict[str, torch.Tensor]] = {}
    checked = 0
    for i in range(start, start + steps + 1):
        train_step(model, opt, i)  # writes the state the previous boundary is copying
        if i - 1 in expected:
            assert snap.wait(timeout=120), "snapshot did not complete"
            arena = parts.arena(snap)
            info, got = read_slot(arena, arena.newest_complete())
            assert info["step"] == i - 1 and info["meta_step"] == i - 1, info
            bad = diff_names(got, expected.pop(i - 1))
            assert not bad, f"step {i - 1}: slot differs from the synchronous clone: {bad[:8]}"
            checked += 1
        if i == start + steps:
            break
        expected[i] = live_state(snap)  # synchronous reference, same boundary
        if parts.cuda(snap) is not None:  # the engine exists from the first boundary on
            parts.cuda(snap).engine.set_test_copy_delay_us(COPY_DELAY_US)
        snap.boundary(i)
    if parts.cuda(snap) is not None:
        parts.cuda(snap).engine.set_test_copy_delay_us(0)
    return checked


def check_rollback(snap: Any, model: nn.Module, opt: Any, first: int, more: int = 3) -> None:
    """Snapshot at step ``first``; train ``more`` steps without one; rollback() == saved."""
    train_step(model, opt, first)
    snap.boundary(first)
    assert snap.wait(timeout=120)
    saved = live_state(snap)
    ptrs = state_ptrs(snap)
    saved_cuda_rng = torch.cuda.get_rng_state()
    saved_lr = [g["lr"] for g in opt.param_groups]
    saved_cpu_rng = torch.get_rng_state()
    for i in range(first + 1, first + 1 + more):
        train_step(model, opt, i)
    torch.rand(8, device="cuda"), torch.rand(8)  # advance both RNG streams
    moved = diff_names(live_state(snap), saved)
    assert len(moved) > len(saved) // 2, "training did not change the state: nothing to test"
    assert snap.rollback() == first + 1
    torch.cuda.synchronize()
    now = live_state(snap)
    bad = diff_names(now, saved)
    assert not bad, f"rollback() differs from the snapshotted state: {bad[:8]}"
    assert state_ptrs(snap) == ptrs, "rollback() moved tensors: bytes must go back in place"
    assert torch.equal(torch.cuda.get_rng_state(), saved_cuda_rng), "CUDA RNG not restored"
    assert torch.equal(torch.get_rng_state(), saved_cpu_rng), "CPU RNG not restored"
    assert [g["lr"] for g in opt.param_groups] == saved_lr
    # training and snapshotting go on after a rollback
    train_step(model, opt, first + 1)
    snap.boundary(first + 1)
    assert snap.wait(timeout=120)
    assert parts.arena(snap).slot_info(parts.arena(snap).newest_complete())["step"] == first + 1


def ema_bytes(ema: nn.Module) -> tuple[int, torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in ema.state_dict().values():
        if t.is_cuda:
            seen.setdefault(t.data_ptr(), t)
    largest = max(seen.values(), key=lambda t: t.numel() * t.element_size())
    return sum(t.numel() * t.element_size() for t in seen.values()), largest


def block_listed(cov: dict[str, Any], t: torch.Tensor) -> bool:
    p = t.data_ptr()
    return any(a <= p < a + s for a, s in (tuple(x) for x in cov["largest_uncovered"]))


# ------------------------------------------------------------------ child processes
def run_child(mode: str, *args: Any, env: dict[str, str] | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    return run_script(__file__, mode, *args, env=env, timeout=timeout)


def save_npz(path: str, state: dict[str, torch.Tensor]) -> None:
    np.savez(path, **{k: as_bytes(v).numpy() for k, v in state.items()})


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def child_crash(a: argparse.Namespace) -> None:
    model, opt = build(seed=0)
    snap = make_snap(model, opt, Path(a.dir), a.job)
    assert snap.restore_latest() == 0
    for i in range(a.steps):
        train_step(model, opt, i)
        snap.boundary(i)
    assert snap.wait(timeout=120)
    save_npz(a.out, live_state(snap))
    print(json.dumps({"pid": os.getpid(), "arena": str(snap.arena_path),
                      "private_arena_reason": parts.cuda(snap).fallback_reason,
                      "backend": snap.stats()["backend"]}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit, no finally


def child_resume(a: argparse.Namespace) -> None:
    model, opt = build(seed=1)  # different initial values: only a restore makes them equal
    snap = make_snap(model, opt, Path(a.dir), a.job)
    start = snap.restore_latest()
    torch.cuda.synchronize()
    save_npz(a.out, live_state(snap))
    for i in range(start, start + 2):  # and it trains on
        train_step(model, opt, i)
        snap.boundary(i)
    assert snap.wait(timeout=120)
    print(json.dumps({"start": start, "restore": snap.stats()["restore"]}), flush=True)
    snap.close()


def child_expandable(a: argparse.Namespace) -> None:
    expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    model, opt = build(seed=2)
    snap = make_snap(model, opt, Path(a.dir), a.job)
    try:
        checked = check_snapshots_equal_clone(snap, model, opt, steps=4)
        check_rollback(snap, model, opt, first=10)
        reg = parts.cuda(snap).registry
        segs = list(reg.segments(0)) if reg is not None else []
        ema = copy.deepcopy(model)
        cov = snap.coverage()
        nbytes, largest = ema_bytes(ema)
        res = {"ok": True, "expandable": expandable, "checked": checked,
               "tracking": reg is not None, "tracker_error": parts.cuda(snap).tracker_error,
               "any_expandable_segment": any(bool(s[2]) for s in segs),
               "ranges": int(parts.layout(snap).plan.num_ranges),
               "ema_bytes": nbytes, "uncovered_bytes": cov.get("uncovered_bytes"),
               "ema_listed": bool(cov.get("available")) and block_listed(cov, largest),
               "private_arena_reason": parts.cuda(snap).fallback_reason}
    finally:
        snap.close()
    print(json.dumps(res), flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["crash", "resume", "expandable"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    {"crash": child_crash, "resume": child_resume, "expandable": child_expandable}[a.mode](a)


# ------------------------------------------------------------------ tests
@pytest.fixture
def cuda_snap(snap_env):
    """A TinyGPT + AdamW on cuda:0 and its Snapshotter (closed afterwards)."""
    made = []

    def make(fused: bool = False, seed: int = 0, **kw: Any):
        m, o = build(seed=seed, fused=fused)
        s = make_snap(m, o, snap_env.dir, snap_env.job, **kw)
        made.append(s)
        return m, o, s

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@gpu
def test_snapshot_equals_sync_clone_while_training_writes(cuda_snap, fused):
    model, opt, snap = cuda_snap(fused=fused)
    assert check_snapshots_equal_clone(snap, model, opt, steps=6) == 6
    st = snap.stats()
    assert st["backend"] == "cuda" and st["snapshots"] == 6 and st["skipped"] == 0, st
    assert st["last_copy_gbps"] and st["last_copy_gbps"] > 0, st
    assert st["staging"]["page_locked"], st["staging"]  # shared + registered, or private pinned
    assert parts.arena(snap).shared or accept_fallback(parts.cuda(snap).fallback_reason), st["staging"]


@gpu
def test_rollback_restores_bit_for_bit_in_place(cuda_snap):
    model, opt, snap = cuda_snap()
    for i in range(3):
        train_step(model, opt, i)
        snap.boundary(i)
    check_rollback(snap, model, opt, first=3, more=4)


@gpu
def test_kill9_child_leaves_complete_slot_a_new_process_restores(snap_env):
    from cudasnap import _C

    steps = 5
    ref = snap_env.tmp / "crash.npz"
    p = run_child("crash", "--dir", snap_env.dir, "--job", snap_env.job, "--steps", steps,
                  "--out", ref)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr)
    info = last_json(p)
    assert info["backend"] == "cuda", info
    arena_path = snap_env.arena_path()
    if accept_fallback(info["private_arena_reason"]):  # a private arena dies with its process
        assert not arena_path.exists(), info
        return
    assert arena_path.exists() and str(arena_path) == info["arena"], info
    arena = _C.Arena.open(str(arena_path), False)
    slot = arena.newest_complete()
    assert slot >= 0, "the killed process left no COMPLETE slot"
    si = arena.slot_info(slot)
    assert si["state"] == "COMPLETE" and si["valid"] and si["step"] == steps - 1, si
    assert si["writer_pid"] == info["pid"], si
    _, raw = read_slot(arena, slot)
    want = load_npz(ref)
    assert sorted(raw) == sorted(want)
    assert all(np.array_equal(raw[k].numpy(), want[k]) for k in want), "slot != child's state"
    del arena, raw

    out = snap_env.tmp / "resumed.npz"
    p = run_child("resume", "--dir", snap_env.dir, "--job", snap_env.job, "--out", out)
    assert p.returncode == 0, (p.stdout, p.stderr)
    r = last_json(p)
    assert r["start"] == steps and r["restore"]["source"] == "shm", r
    got = load_npz(out)
    bad = [k for k in want if not np.array_equal(got.get(k), want[k])]
    assert sorted(got) == sorted(want) and not bad, f"restored state differs: {bad[:8]}"
    assert not arena_path.exists()  # the resumed run closed cleanly


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@gpu
def test_snapshot_rollback_coverage_with_expandable_segments(snap_env, expandable):
    conf = f"expandable_segments:{'True' if expandable else 'False'}"
    p = run_child("expandable", "--dir", snap_env.dir, "--job", snap_env.job,
                  env={"PYTORCH_CUDA_ALLOC_CONF": conf})
    assert p.returncode == 0, (p.stdout, p.stderr)
    r = last_json(p)
    assert r["ok"] and r["expandable"] == expandable and r["checked"] == 4, r
    accept_fallback(r["private_arena_reason"])
    assert r["tracking"], f"allocator tracking unavailable: {r['tracker_error']}"
    assert r["any_expandable_segment"] == expandable, r
    assert r["uncovered_bytes"] >= r["ema_bytes"] and r["ema_listed"], r


@gpu
def test_coverage_reports_an_unregistered_ema_copy(cuda_snap, snap_env):
    model, opt, snap = cuda_snap()
    for i in range(2):
        train_step(model, opt, i)
        snap.boundary(i)
    assert snap.wait(timeout=120)
    import gc

    gc.collect()  # nothing else may die between the two reports
    torch.cuda.synchronize()
    cov0 = snap.coverage()
    assert cov0["available"], cov0
    state = sum(lt.nbytes for lt in snap.state.live_tensors() if lt.tensor.is_cuda)
    assert cov0["covered_bytes"] >= state, cov0

    ema = copy.deepcopy(model).requires_grad_(False)  # a forgotten EMA of the weights
    train_step(model, opt, 2)
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 0.1)
    snap.boundary(2)
    assert snap.wait(timeout=120)
    cov = snap.coverage()
    nbytes, largest = ema_bytes(ema)
    grew = cov["uncovered_bytes"] - cov0["uncovered_bytes"]
    assert grew >= nbytes, (grew, nbytes, cov)
    assert block_listed(cov, largest), ("the EMA's largest tensor is not reported", cov)

    # registered, the EMA is covered
    snap.close()
    import cudasnap

    snap2 = cudasnap.Snapshotter({"model": model, "ema": ema}, opt, directory=snap_env.tmp / "c2",
                                 job=snap_env.sub_job("ema"), health=False)
    try:
        assert snap2.arena_ready(ARENA_READY_S)  # else boundary(3) is skipped
        snap2.boundary(3)
        assert snap2.wait(timeout=120)
        cov2 = snap2.coverage()
        assert not block_listed(cov2, largest), cov2
        assert cov2["uncovered_bytes"] <= cov["uncovered_bytes"] - nbytes + (1 << 20), (cov2, cov)
    finally:
        snap2.close()


@gpu
def test_flushed_cuda_snapshot_restores_into_a_cpu_copy(cuda_snap, snap_env):
    model, opt, snap = cuda_snap()
    for i in range(3):
        train_step(model, opt, i)
        snap.boundary(i)
    assert snap.wait(timeout=120)
    want = live_state(snap)
    path = snap.flush()
    assert path is not None and path.name == "step-00000002"
    snap.close()  # removes the arena: the restore below reads the disk

    cpu_model, cpu_opt = build(seed=5, device="cpu")
    snap2 = make_snap(cpu_model, cpu_opt, snap_env.dir, snap_env.sub_job("cpu"))
    try:
        assert snap2.restore_latest() == 3
        assert snap2.stats()["restore"]["source"] == "disk"
        got = live_state(snap2)
    finally:
        snap2.close()
    assert all(not t.is_cuda for t in cpu_model.state_dict().values())
    bad = diff_names(got, want)
    assert not bad, f"CPU copy differs from the CUDA state: {bad[:8]}"


if __name__ == "__main__":
    main(sys.argv[1:])


def check_regrowth(snap: Any, model: nn.Module, opt: Any, directory: Path, device: str) -> None:
    """A snapshot of step 0 before LazyMomentum's first step; its buffers then grow the
    state past the arena: one regrowth (in the background: boundary 1 is skipped), the
    old arena released (unregistered on CUDA) before the new one is made and step 0
    written to disk first; the next boundary snapshots into the new arena."""
    from cudasnap.storage import posix

    snap.boundary(0)  # parameters only: LazyMomentum has no state yet
    assert snap.wait(timeout=120)
    st = snap.stats()
    assert st["snapshots"] == 1 and st["arena_regrowths"] == 0, st
    train_step(model, opt, 1, device)  # the momentum buffers appear: +1 x parameter bytes
    snap.boundary(1)  # the plan no longer fits: the regrowth starts, this boundary is skipped
    assert snap.arena_ready(ARENA_READY_S), "the regrown arena was not ready"
    st = snap.stats()
    assert st["arena_regrowths"] == 1, st
    assert st["skipped_not_ready"] == 1 and st["snapshots"] == 1, st
    assert any(s.step == 0 for s in posix.list_snapshots(directory)), \
        "step 0 was not written to disk before its arena was replaced"
    if device == "cuda":
        assert parts.cuda(snap).stats()["registered_arenas"] == 0  # the old one: unregistered
    train_step(model, opt, 2, device)
    snap.boundary(2)  # adopts the new arena
    assert snap.wait(timeout=120)
    st = snap.stats()
    assert st["snapshots"] == 2 and st["arena_regrowths"] == 1, st
    assert parts.arena(snap).slot_info(parts.arena(snap).newest_complete())["step"] == 2
    if device == "cuda":
        assert parts.cuda(snap).stats()["registered_arenas"] == 1
        stg = st["staging"]
        assert stg["page_locked"], stg
        accept_fallback(stg["fallback_reason"])


@gpu
def test_arena_regrowth_unregisters_the_old_arena_and_keeps_its_snapshot(snap_env):
    """Issue 11 item 1 on CUDA. (Issue 21 item 3: AdamW's moments are counted when the
    arena is first sized, so nothing regrew: a lazily-stated optimizer here.)"""
    model, opt = build(lazy=True)
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        check_regrowth(snap, model, opt, snap_env.dir, "cuda")
    finally:
        snap.close()


@pytest.mark.slow
def test_arena_regrowth_on_the_cpu_equivalent(snap_env):
    """The same on the CPU backend (no GPU needed): exactly one regrowth."""
    model, opt = build(device="cpu", lazy=True)
    snap = make_snap(model, opt, snap_env.dir, snap_env.job)
    try:
        check_regrowth(snap, model, opt, snap_env.dir, "cpu")
    finally:
        snap.close()
