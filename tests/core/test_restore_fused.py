"""Restore from disk chunk by chunk (issue 26): read -> CRC32C -> copy into the live tensors.

* the engine (``_C.read_file_scatter``, ``RestorePlan.run_file``) copies exactly the bytes the
  spans name, whatever the threads, read size or O_DIRECT, and checks every span and the
  file before the first read;
* a chunk failing its CRC32C: none of its bytes reaches a destination, the error names it,
  and whether earlier chunks were copied is known (``RestorePlan.applied``,
  ``partly_applied`` on the exception);
* through a Snapshotter (``storage.posix.DataFile`` into ``TrainingState.apply``, read by
  ``core.file_copy``) the live
  state ends bitwise equal to the whole-file path's, at a few and at many tensors, with odd
  dtypes, zero-size, non-contiguous, expanded and tied tensors, in place or into an optimizer
  without state; where a destination is not a plain CPU tensor the whole file is read first;
* the new bindings release the GIL without touching a Python object (child process).
"""
from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import parts
from helpers.restore_files import CH, data_file, entry, restore_fresh, same_state, snapshot_to_disk, state_of, trained
from torch import nn

import cudasnap
from cudasnap import storage
from cudasnap.core import apply as apply_mod
from cudasnap.core import file_copy
from cudasnap.core import state as state_mod
from cudasnap.errors import CorruptSnapshot, SnapshotError
from cudasnap.format import paths
from cudasnap.storage import PosixStorage, posix

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def C(native_C):
    return native_C


def _spans(nbytes: int, dst: np.ndarray, seed: int, chunk: int = CH
           ) -> list[tuple[int, int, int]]:
    """Spans covering most of the file in random pieces (many crossing chunk boundaries, some
    bytes left out), each to its own place in ``dst`` (same size, shuffled order)."""
    rnd = random.Random(seed)
    cuts, off = [], 0
    while off < nbytes:
        n = min(nbytes - off, rnd.choice([1, 7, 64, chunk // 3, chunk, chunk + 13, 3 * chunk]))
        cuts.append((off, n))
        off += n
    keep = [c for c in cuts if rnd.random() < 0.9]
    places = list(range(len(keep)))
    rnd.shuffle(places)
    out, at = [], 0
    order = sorted(range(len(keep)), key=lambda i: places[i])
    base = dst.ctypes.data
    for i in order:  # destinations packed in shuffled order: none overlaps another
        off, n = keep[i]
        out.append((base + at, off, n))
        at += n
    return out


def _expected(src: np.ndarray, spans: list[tuple[int, int, int]], dst: np.ndarray,
              fill: int) -> np.ndarray:
    want = np.full_like(dst, fill)
    base = dst.ctypes.data
    for p, off, n in spans:
        want[p - base:p - base + n] = src[off:off + n]
    return want


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("threads, io_bytes, direct", [
    (1, 0, False), (3, 0, False), (2, 3 * CH, False), (2, 0, True), (4, 2 * CH, True)])
def test_read_file_scatter_copies_exactly_the_spans(C, tmp_path, threads, io_bytes, direct):
    nbytes = 37 * CH + 123  # a short last chunk
    path, src, crcs = data_file(C, tmp_path, nbytes)
    dst = np.full(nbytes, 0xAA, dtype=np.uint8)
    spans = _spans(nbytes, dst, seed=threads)
    read0 = C.io_bytes()[1]
    fd = os.open(path, os.O_RDONLY)
    try:
        st = C.read_file_scatter(fd, str(path), nbytes, CH, crcs, spans, threads, io_bytes,
                                 direct)
    finally:
        os.close(fd)
    assert np.array_equal(dst, _expected(src, spans, dst, 0xAA))
    assert st["bytes"] == nbytes and st["applied"] == sum(n for _, _, n in spans)
    assert st["seconds"] > 0 and isinstance(st["direct"], bool)
    assert C.io_bytes()[1] - read0 >= nbytes  # the progress counter sees the reads


@pytest.mark.parametrize("direct", [False, True])
def test_a_chunk_larger_than_the_file(C, tmp_path, direct):
    """One chunk of 1 MiB for 5,000 bytes: the readers' buffers are the file's size."""
    path, src, crcs = data_file(C, tmp_path, 5000, chunk=1 << 20)
    assert len(crcs) == 1
    dst = np.zeros(5000, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        st = C.read_file_scatter(fd, str(path), 5000, 1 << 20, crcs, [(dst.ctypes.data, 0, 5000)],
                                 4, 0, direct)
    finally:
        os.close(fd)
    assert st["applied"] == 5000 and np.array_equal(dst, src)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bad", [0, 5, 12])
def test_a_corrupt_chunk_copies_none_of_its_bytes(C, tmp_path, threads, bad):
    nbytes = 13 * CH  # chunk 12 is the last
    path, src, crcs = data_file(C, tmp_path, nbytes)
    with open(path, "r+b") as f:  # one flipped bit in the middle of chunk `bad`
        f.seek(bad * CH + CH // 2)
        b = f.read(1)
        f.seek(bad * CH + CH // 2)
        f.write(bytes([b[0] ^ 0x10]))
    dst = np.full(nbytes, 0xAA, dtype=np.uint8)
    spans = [(dst.ctypes.data, 0, nbytes)]  # byte i of the file to dst[i]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptSnapshot, match=f"chunk {bad} .*fails its CRC32C.* none of "
                                                  "its bytes was copied"):
            C.read_file_scatter(fd, str(path), nbytes, CH, crcs, spans, threads)
    finally:
        os.close(fd)
    lo, hi = bad * CH, (bad + 1) * CH
    assert (dst[lo:hi] == 0xAA).all()  # nothing of the bad chunk
    for c in range(13):  # every other chunk: untouched, or all of it copied and verified
        part = dst[c * CH:(c + 1) * CH]
        assert (part == 0xAA).all() or np.array_equal(part, src[c * CH:(c + 1) * CH])
    if threads == 1:  # in order: exactly the chunks before the bad one
        assert np.array_equal(dst[:lo], src[:lo]) and (dst[hi:] == 0xAA).all()


def test_spans_and_the_file_are_checked_before_any_read(C, tmp_path):
    nbytes = 4 * CH
    path, src, crcs = data_file(C, tmp_path, nbytes)
    dst = np.full(nbytes, 0xAA, dtype=np.uint8)
    p = dst.ctypes.data
    read0 = C.io_bytes()[1]
    fd = os.open(path, os.O_RDONLY)
    try:
        bad_spans = {
            "outside the file": [(p, 0, 16), (p + 64, nbytes - 8, 16)],
            "overlap": [(p, 0, 100), (p + 50, CH, 100)],
            "null destination": [(p, 0, 16), (0, 64, 16)],
            "wraps around": [(2**64 - 8, 0, 16)],
        }
        for why, spans in bad_spans.items():
            with pytest.raises(SnapshotError, match=why):
                C.read_file_scatter(fd, str(path), nbytes, CH, crcs, spans, 2)
        with pytest.raises(CorruptSnapshot, match="the manifest says"):  # size
            C.read_file_scatter(fd, str(path), nbytes + 1, CH, crcs + [0], [(p, 0, 16)], 2)
        with pytest.raises(CorruptSnapshot, match="chunk checksums"):
            C.read_file_scatter(fd, str(path), nbytes, CH, crcs[:-1], [(p, 0, 16)], 2)
    finally:
        os.close(fd)
    dfd = os.open(tmp_path, os.O_RDONLY)  # a directory: not a regular file
    try:
        with pytest.raises(CorruptSnapshot, match="not a regular file"):
            C.read_file_scatter(dfd, str(tmp_path), nbytes, CH, crcs, [(p, 0, 16)], 2)
    finally:
        os.close(dfd)
    assert (dst == 0xAA).all() and C.io_bytes()[1] == read0  # not a byte read or written
    # zero bytes: nothing to read, nothing to check but the size
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    fd = os.open(empty, os.O_RDONLY)
    try:
        assert C.read_file_scatter(fd, str(empty), 0, CH, [], [], 2)["bytes"] == 0
    finally:
        os.close(fd)




def test_run_file_copies_the_plan_and_the_extra_spans(C, tmp_path):
    nbytes = 9 * CH
    path, src, crcs = data_file(C, tmp_path, nbytes)
    data = torch.empty(nbytes, dtype=torch.uint8)  # stands for the file
    dsts = [torch.zeros(3, 300), torch.zeros(1000, dtype=torch.float64),
            nn.Parameter(torch.zeros(17, dtype=torch.int16), requires_grad=False),
            torch.zeros(5, 7).t()]
    entries = [entry([3, 300], "float32", 0), entry([1000], "float64", 3600),
               entry([17], "int16", 3 * CH + 2), entry([7, 5], "float32", 8 * CH)]
    plan = C.plan_pairs(dsts, entries, *parts.copy_back_kinds(), torch.Tensor,
                        data.data_ptr(), nbytes)
    assert plan.slow == [3] and plan.count == 3  # the transposed destination: torch's copy_
    versions = [d._version for d in dsts]
    extra = [(data.data_ptr() + 8 * CH, 8 * CH, 140)]
    fd = os.open(path, os.O_RDONLY)
    try:
        st = plan.run_file(fd, str(path), nbytes, CH, crcs, extra, 2)
        with pytest.raises(SnapshotError, match="already run"):
            plan.run_file(fd, str(path), nbytes, CH, crcs, extra, 2)
    finally:
        os.close(fd)
    assert st["applied"] == plan.applied == 3600 + 8000 + 34 + 140
    raw = torch.from_numpy(src)
    for d, e in zip(dsts[:3], entries[:3]):
        want = raw[e["offset"]:e["offset"] + e["nbytes"]]
        assert torch.equal(d.detach().contiguous().view(-1).view(torch.uint8), want)
    assert torch.equal(data[8 * CH:8 * CH + 140], raw[8 * CH:8 * CH + 140])
    assert all(d._version > v for d, v in zip(dsts[:3], versions[:3]))
    # planned for another size: refused
    plan2 = C.plan_pairs(dsts[:1], entries[:1], *parts.copy_back_kinds(),
                         torch.Tensor, data.data_ptr(), nbytes - 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(SnapshotError, match="planned for a buffer"):
            plan2.run_file(fd, str(path), nbytes, CH, crcs, [], 2)
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad, partly", [(0, False), (6, True)])
def test_run_file_says_what_a_failed_chunk_left_behind(C, tmp_path, bad, partly):
    nbytes = 8 * CH
    path, src, crcs = data_file(C, tmp_path, nbytes)
    crcs = list(crcs)
    crcs[bad] ^= 1  # the table disagrees with chunk `bad`
    data = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.full((nbytes // 4,), 7.0)
    plan = C.plan_pairs([dst], [entry([nbytes // 4], "float32", 0)], *parts.copy_back_kinds(),
                         torch.Tensor, data.data_ptr(), nbytes)
    v0 = dst._version
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptSnapshot, match=f"chunk {bad} "):
            plan.run_file(fd, str(path), nbytes, CH, crcs, [], 1)
    finally:
        os.close(fd)
    assert plan.applied == bad * CH
    assert (plan.applied > 0) is partly
    assert bool((dst[bad * CH // 4:] == 7.0).all())
    assert (dst._version > v0) is partly  # changed in place, if only partly


# ----------------------------------------------------------- through a Snapshotter
@pytest.fixture
def chunked(monkeypatch):
    """Records each scatter of a restore from disk (``Restorer.restore_dir`` ->
    ``PosixStorage.open_data`` -> ``posix.DataFile`` -> ``TrainingState.apply`` ->
    ``file_copy.run_plan``: the product path, unpatched)."""
    calls: list[dict] = []
    real = file_copy.run_plan

    def scatter(src, plan, extra):
        st = real(src, plan, extra)
        calls.append({"extra": list(extra), **st})
        return st

    monkeypatch.setattr(file_copy, "run_plan", scatter)
    return calls


def _whole(mp: pytest.MonkeyPatch) -> None:
    """Restores from disk take the whole-file path (``storage.read_data``: the data into a
    new buffer, then the copy), the reference the chunk-by-chunk path is compared with."""
    mp.setattr(storage.PosixStorage, "open_data", lambda store, ref, m, threads=4, *,
               allow_foreign_owner=None, ahead=None: store.read_data(
                   ref, m, threads, allow_foreign_owner=allow_foreign_owner))


@pytest.mark.parametrize("n", [0, 400], ids=["few", "many"])
@pytest.mark.parametrize("fresh_optimizer", [False, True], ids=["in-place", "new-optimizer"])
def test_chunked_restore_is_bitwise_the_whole_file_restore(snap_env, chunked, n,
                                                           fresh_optimizer):
    want, _ = snapshot_to_disk(snap_env, n)
    got, step, _ = restore_fresh(snap_env, n, "chunks", fresh_optimizer)
    assert step == 1 and len(chunked) == 1
    scattered = chunked[0]
    assert scattered["applied"] > 0
    # the non-contiguous and expanded buffers (torch's copy_) read their bytes through `extra`
    assert scattered["extra"], "no byte range read for torch's copies"
    with pytest.MonkeyPatch.context() as mp:
        _whole(mp)
        old, step_old, _ = restore_fresh(snap_env, n, "whole", fresh_optimizer)
    assert len(chunked) == 1
    assert step_old == 1
    same_state(got, want)
    same_state(got, old)


def test_a_destination_torch_must_copy_to_reads_the_whole_file_first(snap_env, monkeypatch,
                                                                      chunked):
    """Where the chunk-by-chunk path cannot go (a CUDA or sharded destination: here forced
    with apply.scatters), the whole file is read and checked first, then copied; closed after."""
    want, _ = snapshot_to_disk(snap_env, 20)
    opened: list[posix.DataFile] = []
    reads: list[int] = []
    real_init, real_read = posix.DataFile.__init__, file_copy.read_whole

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        opened.append(self)

    monkeypatch.setattr(posix.DataFile, "__init__", init)
    monkeypatch.setattr(file_copy, "read_whole", lambda src: reads.append(1) or real_read(src))
    monkeypatch.setattr(apply_mod, "scatters", lambda state, lts, tensors: False)
    got, step, _ = restore_fresh(snap_env, 20, "fallback")
    assert step == 1 and reads == [1] and not chunked
    assert opened and all(f.fd == -1 for f in opened)  # closed once read
    same_state(got, want)


def test_scatters_only_for_plain_cpu_unsharded_state():
    m, opt = trained(3, seed=0)
    st = state_mod.TrainingState(m, opt)
    lts = st.live_tensors()
    plain = [{"name": "x", "group": "model:model"}]
    assert apply_mod.scatters(st, lts, plain)
    assert not apply_mod.scatters(st, lts, [{"name": "x", "group": "model:model", "shard": {}}])
    lts[0].tensor = torch.empty(2, device="meta")  # not on the CPU (a CUDA tensor alike)
    assert not apply_mod.scatters(st, lts, plain)


def test_a_late_corrupt_chunk_falls_back_to_the_older_snapshot_bitwise(snap_env, chunked):
    """The newest snapshot's last chunk is damaged: its earlier chunks reach the live
    tensors, then the restore goes on to the older snapshot, which overwrites them all."""
    want_last, dirs = snapshot_to_disk(snap_env, 50, steps=2)
    data = dirs[1] / paths.DATA
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(size - 10)
        b = f.read(1)
        f.seek(size - 10)
        f.write(bytes([b[0] ^ 0x01]))
    # the state of step 0, for comparison: restore it from its own directory
    m0, o0 = trained(50, seed=1)
    s0 = cudasnap.Snapshotter(m0, o0, directory=snap_env.dir, chunk_bytes=CH,
                              job=snap_env.sub_job("ref"))
    try:
        assert s0.restore_dir(dirs[0]) == 0
        want0 = state_of(m0, o0)
    finally:
        s0.close(flush=False)
    chunked.clear()
    got, step, snap = restore_fresh(snap_env, 50, "fallback-old")
    assert step == 1  # step 0 restored: resume at 1
    assert [c["applied"] > 0 for c in chunked] == [True]  # step 0's scatter (step 1's raised)
    same_state(got, want0)
    assert snap.last_restore()["where"] == str(dirs[0])


@pytest.mark.parametrize("last", [False, True], ids=["first-chunk", "last-chunk"])
def test_the_exception_says_whether_earlier_chunks_were_applied(snap_env, chunked, last):
    _, dirs = snapshot_to_disk(snap_env, 50)
    data = dirs[0] / paths.DATA
    at = data.stat().st_size - 10 if last else 10
    with open(data, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    m, opt = trained(50, seed=1)
    before = state_of(m, opt)
    st = state_mod.TrainingState(m, opt)
    manifest = posix.load_manifest(dirs[0] / paths.MANIFEST)
    f = posix.DataFile(dirs[0], manifest, 1)  # one reader: the chunks in order
    with pytest.raises(CorruptSnapshot, match="fails its CRC32C") as ei:
        st.apply(manifest["tensors"], manifest["host"], f, str(dirs[0]))
    assert ei.value.partly_applied is last  # type: ignore[attr-defined]
    assert f.fd == -1
    if not last:
        same_state(state_of(m, opt), before)  # nothing reached the live state


def test_a_half_applied_snapshot_with_nothing_older_is_reported(snap_env):
    """Restorer._apply records ``partly_applied``: with no other snapshot to restore,
    restore_latest says the live state is no longer the initial one (not a silent step 0)."""
    _, dirs = snapshot_to_disk(snap_env, 50)
    data = dirs[0] / paths.DATA
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(size - 10)
        b = f.read(1)
        f.seek(size - 10)
        f.write(bytes([b[0] ^ 0x01]))
    m, opt = trained(50, seed=1)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, chunk_bytes=CH,
                                job=snap_env.sub_job("half"))
    try:
        with pytest.raises(CorruptSnapshot, match="failed half-way"):
            snap.restore_latest()
    finally:
        snap.close(flush=False)


class _Vote:
    """A coordinator whose restore round tries one local snapshot as the vote does
    (cudasnap.distributed.restore_vote: a CorruptSnapshot there is "not loadable here") and finds
    nothing older: the round returns 0."""

    def __init__(self, snap: cudasnap.Snapshotter, d: Path) -> None:
        self.snap, self.d = snap, d

    def restore(self) -> int:
        try:
            return self.snap.restore_dir(self.d) + 1
        except CorruptSnapshot:
            return 0


@pytest.mark.parametrize("last", [False, True], ids=["first-chunk", "last-chunk"])
def test_a_half_applied_snapshot_is_reported_after_a_coordinated_round(snap_env, chunked,
                                                                        last):
    """Through the coordinator (its restore_dir of a rank directory), a snapshot that failed
    half-way with nothing restored raises as restore_latest does alone; a damaged first
    chunk copied nothing: the round's 0 stands, the live state untouched."""
    _, dirs = snapshot_to_disk(snap_env, 50)
    data = dirs[0] / paths.DATA
    at = data.stat().st_size - 10 if last else 10
    with open(data, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    m, opt = trained(50, seed=1)
    before = state_of(m, opt)
    snap = cudasnap.Snapshotter(m, opt, directory=snap_env.dir, chunk_bytes=CH,
                                job=snap_env.sub_job("vote"))
    try:
        parts.restorer(snap).attach(_Vote(snap, dirs[0]), None)
        if last:
            with pytest.raises(CorruptSnapshot, match="failed half-way"):
                snap.restore_latest()
        else:
            assert snap.restore_latest() == 0
            same_state(state_of(m, opt), before)
        assert len(chunked) == 0  # the scatter raised
    finally:
        snap.close(flush=False)


def test_data_file_checks_before_any_read(snap_env, C):
    _, dirs = snapshot_to_disk(snap_env, 0)
    d = dirs[0]
    manifest = posix.load_manifest(d / paths.MANIFEST)
    read0 = C.io_bytes()[1]
    bad = dict(manifest, data=dict(manifest["data"], file="../x"))
    with pytest.raises(CorruptSnapshot, match="data file must be 'data.bin'"):
        posix.DataFile(d, bad)
    grown = dict(manifest, data=dict(manifest["data"], bytes=manifest["data"]["bytes"] + 1))
    with pytest.raises(CorruptSnapshot, match="the manifest says"):
        posix.DataFile(d, grown)
    real = d / paths.DATA
    os.rename(real, d / "elsewhere")
    try:
        with pytest.raises(CorruptSnapshot, match="missing"):
            posix.DataFile(d, manifest)
        os.symlink(d / "elsewhere", real)
        with pytest.raises(CorruptSnapshot, match="not a regular file"):
            posix.DataFile(d, manifest)
    finally:
        if real.is_symlink():
            real.unlink()
        os.rename(d / "elsewhere", real)
    assert C.io_bytes()[1] == read0
    f = posix.DataFile(d, manifest)
    assert f.fd >= 0 and f.nbytes == manifest["data"]["bytes"]
    with f:
        buf = file_copy.read_whole(f)
        assert f.fd >= 0  # a record: read by core, closed by its owner (``with``)
    assert f.fd == -1
    assert torch.equal(buf, posix.read_data(d, manifest))
    # open_data: a DataFile for a local snapshot of a PosixStorage (checked, not read)
    store = PosixStorage(snap_env.dir)
    ref = posix.StoredSnapshot(0, d)
    got = store.open_data(ref, manifest)
    assert isinstance(got, posix.DataFile) and got.fd >= 0
    got.close()


def test_apply_holds_the_cyclic_gc_off_and_restores_it(snap_env, chunked, monkeypatch):
    snapshot_to_disk(snap_env, 0)
    seen: list[bool] = []
    real = parts.apply_state()
    parts.replace_apply_state(monkeypatch,
                        lambda *a: seen.append(gc.isenabled()) or real(*a))
    assert gc.isenabled()
    restore_fresh(snap_env, 0, "gc-on")
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        restore_fresh(snap_env, 0, "gc-off")
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


@pytest.mark.slow
def test_the_new_bindings_release_the_gil_without_python_objects(tmp_path):
    """The build's GIL assertion aborts on a reference count change without the GIL: run
    the new bindings (and their failures) in a child, with threads racing them."""
    code = f"""
        import os, threading
        import numpy as np, torch
        from cudasnap._native import native
        from cudasnap.core import copy_back, file_copy
        from cudasnap.errors import CorruptSnapshot
        C = native()
        CH = 4096
        n = 40 * CH + 5
        src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        path = {str(tmp_path / "g.bin")!r}
        crcs = C.write_buffer_file(src.ctypes.data, n, CH, path, 2, 1 << 20, False)["crc32c"]
        def once():
            dst = np.zeros(n, dtype=np.uint8)
            fd = os.open(path, os.O_RDONLY)
            try:
                C.read_file_scatter(fd, path, n, CH, crcs, [(dst.ctypes.data, 0, n)], 2)
                assert np.array_equal(dst, src)
                try:
                    C.read_file_scatter(fd, path, n, CH, [c ^ 1 for c in crcs],
                                        [(dst.ctypes.data, 0, n)], 2)
                except CorruptSnapshot:
                    pass
                data = torch.empty(n, dtype=torch.uint8)
                t = torch.zeros(n // 4)
                e = {{"dtype": "float32", "shape": [n // 4], "stride": [1], "offset": 0,
                      "nbytes": n // 4 * 4}}
                plan = C.plan_pairs([t], [e], *parts.copy_back_kinds(),
                                    torch.Tensor, data.data_ptr(), n)
                ahead = C.FileReadAhead(fd, n // 2, 4096)
                st = plan.run_file(fd, path, n, CH, crcs, [(data.data_ptr() + n - 5, n - 5, 5)],
                                   2, 0, False, ahead)
                assert plan.applied == n // 4 * 4 + 5 and st["ahead"] <= n // 2
                assert ahead.finish() == ahead.held and ahead.error == ""
                ahead.release()
                assert ahead.held == 0
                spare = C.FileReadAhead(fd, n)  # read whole by the whole-file path
                dst2 = np.zeros(n, dtype=np.uint8)
                C.read_file_scatter(fd, path, n, CH, crcs, [(dst2.ctypes.data, 0, n)], 2, 0,
                                    False, spare)
                assert np.array_equal(dst2, src)
                del ahead, spare  # the readers joined: freed with the GIL held
            finally:
                os.close(fd)
        ts = [threading.Thread(target=lambda: [once() for _ in range(10)]) for _ in range(3)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print("ok")
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, f"child exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.splitlines()[-1] == "ok"


def test_the_data_file_is_closed_when_the_restore_fails_before_reading_it(snap_env,
                                                                           monkeypatch):
    """restore_dir closes the DataFile it opened however the apply ends, also when it fails
    before apply's own ``with`` (no descriptor left to the garbage collector)."""

    snapshot_to_disk(snap_env, 0)
    opened: list[posix.DataFile] = []
    real_open = storage.PosixStorage.open_data

    def spy(*a, **kw):
        d = real_open(*a, **kw)
        opened.append(d)
        return d

    def fail(self, *a, **kw):
        raise CorruptSnapshot("injected before the apply")

    monkeypatch.setattr(storage.PosixStorage, "open_data", spy)
    parts.replace_restorer_apply(monkeypatch, fail)
    _, step, _ = restore_fresh(snap_env, 0, "closed")
    assert step == 0 and opened and all(isinstance(d, posix.DataFile) for d in opened)
    assert [d.fd for d in opened] == [-1] * len(opened)
