"""Issue 44 item 1, one rank: a ``close()`` inside an ``except`` block (a trainer's own
exception path) keeps the arena, after its final flush; a normal ``close()`` removes it;
``close(keep_arena=False)`` removes it even there."""
from __future__ import annotations

import torch
from torch import nn

import cudasnap
from cudasnap.storage import posix


def _trained(env) -> cudasnap.Snapshotter:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = cudasnap.Snapshotter(model, opt, env.dir, health=False)
    for step in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        snap.boundary(step)
    snap.wait()
    return snap


def test_close_during_an_exception_keeps_the_arena_and_flushes(snap_env) -> None:
    snap = _trained(snap_env)
    arena = snap.arena_path
    try:
        raise RuntimeError("the trainer failed")
    except RuntimeError:
        snap.close()
    assert arena.exists(), "the arena holds the newest state: a restart resumes from it"
    assert [s.step for s in posix.list_snapshots(snap_env.dir)][:1] == [2]


def test_a_normal_close_removes_the_arena_once_the_step_is_on_disk(snap_env) -> None:
    snap = _trained(snap_env)
    arena = snap.arena_path
    snap.close()
    assert not arena.exists()
    assert [s.step for s in posix.list_snapshots(snap_env.dir)][:1] == [2]


def test_close_keep_arena_false_removes_it_even_during_an_exception(snap_env) -> None:
    snap = _trained(snap_env)
    arena = snap.arena_path
    try:
        raise RuntimeError("the trainer failed")
    except RuntimeError:
        snap.close(keep_arena=False)
    assert not arena.exists()


def test_a_clean_sys_exit_is_no_failure(snap_env) -> None:
    snap = _trained(snap_env)
    arena = snap.arena_path
    try:
        raise SystemExit(0)
    except SystemExit:
        snap.close()
    assert not arena.exists()
