"""Issue 21 item 8 on the CPU backend: the copy workers read the state by address, so
every planned storage stays allocated until no worker can read it any more.

* ``p.data = ...`` right after ``boundary()`` while the copy is stalled: the old
  storage is not freed (a same-size tensor allocated and written then cannot take
  its memory), and the COMPLETE slot holds the state of that boundary.
* A copy cancelled by a fence's bounded wait fails at once, but a worker may still
  be inside a chunk: its storages stay held until the engine accepted the next job
  (or close() joined the workers). Dropping them at once freed (munmapped) a 64 MB
  tensor under the worker's memcpy: a segfault (run in a subprocess here).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import parts
from helpers.slots import read_slot
from torch.multiprocessing.reductions import StorageWeakRef

from cudasnap import Snapshotter


def _slot_bytes(arena, slot: int) -> tuple[int, dict[str, bytes]]:
    info, raw = read_slot(arena, slot)  # CRC-checked
    return info["meta_step"], {k: bytes(v.numpy()) for k, v in raw.items()}


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def test_swapped_parameter_storage_held_during_cpu_copy(snap_env, native_C):
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16384)) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshotter(model, opt, directory=snap_env.dir, health=False, flush_on_close=False)
    try:
        snap.boundary(1)
        assert snap.wait(30)
        want = {f"model.{i}": _bytes(p) for i, p in enumerate(model)}
        parts.engine(snap).set_test_chunk_delay_us(10_000_000)  # stalled until released below
        snap.boundary(2)
        olds, junk = [], []
        for p in model:
            olds.append((StorageWeakRef(p.untyped_storage()), p.data_ptr()))
            p.data = torch.empty_like(p)
            x = torch.empty_like(p)  # the freed memory, were nothing holding it
            x.copy_(torch.full_like(p, 99.0))
            junk.append(x)
        assert not parts.job(snap).done(1)
        freed = [i for i, (r, _) in enumerate(olds) if r.expired()]
        reused = {x.data_ptr() for x in junk} & {ptr for _, ptr in olds}
        parts.engine(snap).set_test_chunk_delay_us(0)
        assert snap.wait(30)
        step, got = _slot_bytes(parts.arena(snap), parts.arena(snap).newest_complete())
        assert step == 2
        bad = sorted(n for n in want if got[n] != want[n])
        assert bad == [], f"the COMPLETE slot does not hold the state at boundary(2): {bad}"
        assert freed == [] and not reused, (freed, reused)
    finally:
        snap.close()


_CANCEL = textwrap.dedent("""
    import gc, sys, tempfile, time, torch
    from torch.multiprocessing.reductions import StorageWeakRef
    import cudasnap
    sys.path.insert(0, "tests")  # cwd: the repository
    from helpers import parts
    N = 64 << 20  # one 64 MB tensor in one chunk: one worker memcpys it for ~10+ ms
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(N // 4))])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = cudasnap.Snapshotter(model, opt, directory=sys.argv[1], health=False,
                                flush_on_close=False, chunk_bytes=N,
                                arena_sync_max_bytes=1 << 34)
    snap.boundary(1)
    assert snap.wait(60)
    parts.engine(snap).wait_timeout_s = 0.002
    snap.boundary(2)
    snap.fence()  # waits 2 ms, then cancels the job while the worker still copies
    p = model[0]
    ref = StorageWeakRef(p.untyped_storage())
    p.data = torch.empty(0)
    snap.invalidate_layout()
    assert snap.wait(60)  # retires the failed job
    gc.collect()
    print("held after the cancelled job was retired:", not ref.expired(), flush=True)
    parts.engine(snap).wait_timeout_s = 60.0
    model[0].data = torch.ones(16)
    snap.boundary(3)  # accepted: the cancelled copy's worker is done
    assert snap.wait(60)
    gc.collect()
    print("released after the next job:", ref.expired(), flush=True)
    snap.close()
""")


@pytest.mark.slow
def test_cancelled_cpu_copy_keeps_its_storages_until_the_workers_are_done(snap_env):
    r = subprocess.run([sys.executable, "-c", _CANCEL, str(snap_env.dir)], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"rc {r.returncode} (-11: the worker read a freed tensor)\n{out}"
    assert "held after the cancelled job was retired: True" in out, out
    assert "released after the next job: True" in out, out
