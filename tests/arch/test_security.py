"""Hostile snapshots and shared places: paths, sizes, pickle, permissions, ownership.

* tensor names and paths from a manifest never become file paths: the data file is
  always ``data.bin`` of the step directory (checked both statically and by recording
  every file a restore opens, with names like ``../../x`` and ``/etc/passwd``);
* sizes and offsets are checked against the file before any byte is read; symlinks,
  FIFOs and devices in place of snapshot files are refused without blocking;
* nothing is unpickled anywhere: a live ``__reduce__`` payload planted in data.bin,
  manifest fields, extra state, the arena, ``latest`` and the flush log never runs;
* files 0600, directories 0700, arenas 0600 even under umask 0; a snapshot writable by
  group/others loads with a warning; one owned by another user is refused unless
  allowed; so is another user's (or a world-writable) staging arena.
"""
from __future__ import annotations

import ast
import base64
import contextlib
import inspect
import json
import os
import pickle
import shutil
import stat
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import cudasnap
from cudasnap._native import native
from cudasnap.errors import ConfigError, CorruptSnapshot, IncompatibleSnapshot, StagingError
from cudasnap.format import manifest as M
from cudasnap.format import paths
from cudasnap.snapshotter import Snapshotter
from cudasnap.storage import latest, listing, posix, safe_io
from tools.faults import layout as L
from tools.faults.trainlib import Job

PKG = Path(cudasnap.__file__).resolve().parent
FOREIGN_UID = 12345


def _snap(j, d, job, **kw):
    return Snapshotter(j.model, j.opt, directory=d, job=job, extra=kw.pop("extra", j.extra()),
                       chunk_bytes=4096, copy_threads=1, **kw)


def _make(d: Path, job: str, steps: int = 2, dim: int = 16, keep_arena: bool = False,
          extra=None) -> tuple[Path, dict]:
    """Trains and flushes ``steps`` steps; returns (newest step dir, digests of the newest)."""
    j = Job(dim=dim)
    s = _snap(j, d, job, extra=extra if extra is not None else j.extra())
    try:
        for k in range(steps):
            j.step()
            s.boundary(k)
            s.wait()
            path = s.flush()
        dig = j.digests()
    finally:
        s.close(keep_arena=keep_arena)
    return path, dig


def _restore(d: Path, job: str, dim: int = 16, **kw):
    j = Job(dim=dim)
    s = _snap(j, d, job, **kw)
    try:
        return s.restore_latest(), j
    finally:
        s.close()


def _rewrite_manifest(step_dir: Path, fn) -> None:
    """Edits a manifest and recomputes its checksum (a forger's edit, not damage)."""
    man = step_dir / paths.MANIFEST
    m = json.loads(man.read_bytes())
    fn(m)
    m.pop(M.MANIFEST_CRC, None)
    m[M.MANIFEST_CRC] = M.manifest_crc(m)
    man.write_text(json.dumps(m))


@pytest.fixture
def job(snap_env):
    return snap_env.job


# ---------------------------------------------------------------- paths

HOSTILE_KEYS = ["../../../escape", "/etc/passwd", "a/../../b", "..", "data.bin", "~root"]


def test_tensor_names_never_become_paths(snap_env, tmp_path, monkeypatch):
    """Model keys that look like paths round-trip as plain names; a restore opens only
    the lock, the probe, manifest.json and data.bin of step directories and the arena."""
    d = snap_env.dir
    models = {k: torch.nn.Linear(4, 4) for k in HOSTILE_KEYS}
    s = Snapshotter(models, None, directory=d, job=snap_env.job, chunk_bytes=4096)
    s.boundary(0)
    s.wait()
    s.flush()
    s.close()
    before = {p for p in tmp_path.rglob("*")}

    opened: list[str] = []
    real_open, real_os_open = open, os.open
    C = native()
    real_read = C.read_file_verified

    def rec_open(file, *a, **k):
        opened.append(os.fspath(file) if not isinstance(file, int) else f"fd:{file}")
        return real_open(file, *a, **k)

    def rec_os_open(path, *a, **k):
        opened.append(os.fspath(path))
        return real_os_open(path, *a, **k)

    def rec_read(path, *a):
        opened.append(path)
        return real_read(path, *a)

    models2 = {k: torch.nn.Linear(4, 4) for k in HOSTILE_KEYS}
    s = Snapshotter(models2, None, directory=d, job=snap_env.sub_job("r"), chunk_bytes=4096)
    monkeypatch.setattr("builtins.open", rec_open)
    monkeypatch.setattr(os, "open", rec_os_open)
    monkeypatch.setattr(C, "read_file_verified", rec_read)
    try:
        assert s.restore_latest() == 1
    finally:
        monkeypatch.undo()
        s.close()
    for k in HOSTILE_KEYS:
        assert torch.equal(models2[k].weight, models[k].weight)
    step = d / "step-00000000"
    allowed = {str(step / paths.MANIFEST), str(step / paths.DATA), str(d / ".lock")}
    bad = [p for p in opened if p not in allowed and not p.startswith(str(d / ".probe-"))
           and not p.startswith("/proc/") and not p.startswith("/sys/")]
    assert not bad, f"restore opened {bad}"
    assert str(step / paths.DATA) in opened
    created = {p for p in tmp_path.rglob("*")} - before
    assert all(str(p).startswith(str(d)) for p in created), created


def test_data_file_name_comes_from_the_code_not_the_manifest(snap_env):
    path, _ = _make(snap_env.dir, snap_env.job)
    C = native()
    for bad in ["../../etc/passwd", "/etc/passwd", "data.bin/../data.bin", "data.bin\x00x",
                "sub/data.bin", "", None, 7]:
        q = snap_env.tmp / f"copy-{uuid.uuid4().hex[:6]}" / path.name
        shutil.copytree(path, q)
        _rewrite_manifest(q, lambda m: m["data"].__setitem__("file", bad))
        with pytest.raises(CorruptSnapshot, match="data file must be 'data.bin'"):
            posix.load_manifest(q / paths.MANIFEST)
        m = json.loads((q / paths.MANIFEST).read_bytes())  # a caller that skipped validation
        with pytest.raises(CorruptSnapshot, match="data.bin"):
            posix.read_data(q, m)
    # Names with NUL bytes, and names the manifest repeats, are refused too.
    for names in (["a\x00b"], ["dup", "dup"]):
        q = snap_env.tmp / f"copy-{uuid.uuid4().hex[:6]}" / path.name
        shutil.copytree(path, q)

        def rename(m, names=names):
            for e, n in zip(m["tensors"], names):
                e["name"] = n
        _rewrite_manifest(q, rename)
        with pytest.raises(CorruptSnapshot, match="name"):
            posix.load_manifest(q / paths.MANIFEST)
    assert C is native()


def test_no_code_path_builds_a_path_from_manifest_strings():
    """Static proof: every ``a / b`` in the storage modules that write (posix.py and the
    modules split from it: latest, listing, safe_io; the multi-rank round; the object-store
    modules) joins a constant, a name built from ints (step, pid, rank) or ``subdir`` (the rank
    name from cudasnap.format.paths) -- never a string read from a manifest. A new join, or a
    new module of that writer, fails this test until reviewed."""
    reviewed = {
        "DATA", "MANIFEST", "LATEST", "LATEST_LOCK", "FLUSH_LOG", "DIST_LOG", "step_dirname(step)",
        "subdir",
        "step_dirname(cur_step)",
        "'.lock' if rank == 0 else f'.lock-rank{rank}'", "f'.probe-{os.getpid()}'",
        "f'.{LATEST}.tmp-{os.getpid()}'", "f'{step_dirname(step)}.tmp-{os.getpid()}'",
        "f'{subdir}.tmp-{os.getpid()}'", "COMMIT", "f'.{COMMIT}.tmp-{os.getpid()}'",
        "1000000.0", "1000000000.0", "max(elapsed, 1e-09)",  # arithmetic, not paths
        "max(dt, 1e-09)",
        # the multi-rank round and the object-store modules: rank names from int ranks (a
        # COMMIT record's ranks are kept only when they are ints), the id file, and the URL's
        # local state directory (a hash of the user's URL, never a manifest string)
        "rank_dirname(rank)", "rank_dirname(r)", "ID_FILE", "URL_FILE", "'.cache'", "'cudasnap'",
        "f'url-{url_hash(url)}'",
        # the fresh start's move (fresh.py): a UTC time stamp and a counter, the names of
        # what the directory listing and the constants give, a step from an int
        "f'.old-{stamp}'", "f'.old-{stamp}-{n}'", "p.name", "n", "paths.step_dirname(step)",
        "subdir or ''",
        # the package (__init__.py): a one-rank view of a multi-rank step, ranks as ints
        "rank_dirname(int(r))",
    }
    modules = ("posix.py", "latest.py", "ownership.py", "listing.py", "safe_io.py", "remote_ranks.py",
               "remote_latest.py", "remote_base.py", "remote_report.py", "fsspec.py", "fresh.py",
               "object_dir.py", "registry.py", "slots.py", "protocol.py",
               "__init__.py", "data_file.py")
    storage = {p.name for p in (PKG / "storage").glob("*.py")}
    assert storage <= {*modules, "counters.py", "partial.py",
                       "progress.py", "types.py"}, f"new storage modules to review: {storage}"
    for name in modules:
        t = ast.parse((PKG / "storage" / name).read_text())
        joins = {ast.unparse(n.right) for n in ast.walk(t)
                 if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
        assert joins <= reviewed, f"unreviewed path joins in storage/{name}: {joins - reviewed}"
    tree = ast.parse((PKG / "storage" / "posix.py").read_text())
    read_data = next(n for n in ast.walk(tree)
                     if isinstance(n, ast.FunctionDef) and n.name == "read_data")
    assert "Path(snapshot_dir) / DATA" in ast.unparse(read_data)


# ---------------------------------------------------------------- sizes

def test_sizes_and_ranges_checked_before_any_read(snap_env, monkeypatch):
    path, _ = _make(snap_env.dir, snap_env.job)
    C = native()
    calls = []
    real = C.read_file_verified
    monkeypatch.setattr(C, "read_file_verified", lambda *a: calls.append(a) or real(*a))
    size = (path / paths.DATA).stat().st_size
    original = (path / paths.MANIFEST).read_bytes()

    def grow(m):
        m["data"]["bytes"] = size + 8192
        m["data"]["crc32c"] += [0, 0]
    _rewrite_manifest(path, grow)
    m = posix.load_manifest(path / paths.MANIFEST)  # self-consistent: valid
    with pytest.raises(CorruptSnapshot, match=f"is {size} bytes, the manifest says {size + 8192}"):
        posix.read_data(path, m)
    assert not calls  # refused before the reader ran
    cases = {
        "outside the data": lambda m: m["tensors"][0].__setitem__("offset", size + 8192),
        "disagrees with shape": lambda m: m["tensors"][0].__setitem__(
            "shape", [x + 1 for x in m["tensors"][0]["shape"]] or [2]),
        "unsupported dtype": lambda m: m["tensors"][0].__setitem__("dtype", "object"),
        "not aligned": lambda m: m["tensors"][0].__setitem__("offset", 2),
    }
    for want, fn in cases.items():
        (path / paths.MANIFEST).write_bytes(original)
        _rewrite_manifest(path, fn)
        with pytest.raises(CorruptSnapshot, match=want):
            posix.load_manifest(path / paths.MANIFEST)


@contextlib.contextmanager
def _deadline(seconds: float):
    """Fails (instead of hanging the suite) when the body blocks."""
    done = threading.Event()
    result: dict = {}

    def watchdog():
        if not done.wait(seconds):
            result["hung"] = True
            os.kill(os.getpid(), 14)  # SIGALRM: interrupts a blocking open()/read()

    import signal

    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("hung")))
    t = threading.Thread(target=watchdog, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGALRM, old)
    assert not result.get("hung")


def test_symlinks_fifos_and_devices_are_refused_without_blocking(snap_env):
    path, _ = _make(snap_env.dir, snap_env.job)
    d = snap_env.dir
    C = native()
    m = posix.load_manifest(path / paths.MANIFEST)
    data = path / paths.DATA
    real = snap_env.tmp / "real-data.bin"
    shutil.move(data, real)
    data.symlink_to(real)
    with pytest.raises(CorruptSnapshot, match="not a regular file"):
        posix.read_data(path, m)
    buf = torch.empty(m["data"]["bytes"], dtype=torch.uint8)
    with pytest.raises(CorruptSnapshot, match="symbolic link"):  # the C reader, on its own
        C.read_file_verified(str(data), buf.data_ptr(), buf.numel(), 4096,
                             m["data"]["crc32c"], 1)
    data.unlink()
    os.mkfifo(data)
    with _deadline(10), pytest.raises(CorruptSnapshot, match="not a regular file"):
        posix.read_data(path, m)
    data.unlink()
    shutil.move(real, data)
    man = path / paths.MANIFEST
    saved = snap_env.tmp / "manifest.json"
    shutil.move(man, saved)
    os.mkfifo(man)
    with _deadline(10), pytest.raises(CorruptSnapshot, match="not a regular file"):
        posix.load_manifest(man)
    man.unlink()
    man.symlink_to("/dev/zero")
    with _deadline(10), pytest.raises(CorruptSnapshot, match="symbolic link"):
        posix.load_manifest(man)
    man.unlink()
    shutil.move(saved, man)
    (d / "latest").unlink()
    os.mkfifo(d / "latest")
    with _deadline(10):
        assert latest.read_latest(d) is None
    (d / "latest").unlink()
    # A step directory that is a symlink is not a snapshot.
    (d / "step-00000099").symlink_to(path)
    assert [s.step for s in posix.list_snapshots(d)] == [1, 0]


# --------------------------------------------------------------- pickle

class _Payload:
    """Unpickling this runs os.mkdir(marker): proof that a loader unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class _Blob:
    """An `extra` object whose state holds raw bytes (here: a pickle payload)."""

    def __init__(self, blob: bytes = b"") -> None:
        self.blob = blob

    def state_dict(self):
        return {"blob": self.blob}

    def load_state_dict(self, d):
        self.blob = d["blob"]


@contextlib.contextmanager
def _no_unpickling(monkeypatch):
    calls = []

    def trap(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called during restore")
        return f
    for mod, attr in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                      (torch, "load"), (np, "load")):
        monkeypatch.setattr(mod, attr, trap(f"{mod.__name__}.{attr}"))
    try:
        yield calls
    finally:
        monkeypatch.undo()


def test_nothing_is_ever_unpickled(snap_env, monkeypatch):
    marker = snap_env.tmp / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    # The payload is live: unpickling it does create its marker.
    probe = snap_env.tmp / "probe-marker"
    pickle.loads(pickle.dumps(_Payload(probe)))
    assert probe.is_dir()

    d = snap_env.dir
    j = Job(dim=16)
    blob = _Blob(payload)
    s = _snap(j, d, snap_env.job, extra={**j.extra(), "blob": blob})
    for k in range(3):
        j.step()
        s.boundary(k)
        s.wait()
        s.flush()
    s.close(keep_arena=True)  # the arena (shared memory) carries the payload too
    newest = d / "step-00000002"
    # data.bin of the newest: the payload (padded), with checksums recomputed to match.
    raw = (newest / paths.DATA).read_bytes()
    forged = (payload * (len(raw) // len(payload) + 1))[:len(raw)]
    (newest / paths.DATA).write_bytes(forged)
    C = native()
    crcs = [C.crc32c(forged[i:i + 4096]) for i in range(0, len(forged), 4096)]
    b64 = base64.b64encode(payload).decode()

    def plant(m):
        m["data"]["crc32c"] = crcs
        m["evil"] = payload.decode("latin-1")
        m["host"]["extra"]["sched"]["state"]["evil"] = {"__bytes__": b64}
    _rewrite_manifest(newest, plant)
    # Older snapshot's manifest replaced by the raw payload; latest and the flush log too.
    (d / "step-00000001" / paths.MANIFEST).write_bytes(payload)
    (d / "latest").write_bytes(payload)
    with open(d / paths.FLUSH_LOG, "ab") as f:
        f.write(payload + b"\n")
    # The arena: payload bytes in its spare header page.
    arena = snap_env.arena_path()
    with open(arena, "r+b") as f:
        f.seek(3000)
        f.write(payload[:1000])

    with _no_unpickling(monkeypatch) as calls:
        j2 = Job(dim=16)
        blob2 = _Blob()
        s2 = _snap(j2, d, snap_env.job, extra={**j2.extra(), "blob": blob2})
        try:
            start = s2.restore_latest()  # from shared memory (step 2): blob comes back as bytes
            assert start == 3 and blob2.blob == payload and isinstance(blob2.blob, bytes)
        finally:
            s2.close()
        latest.read_latest(d)
        listing.read_flush_log(d)
        with pytest.raises(CorruptSnapshot):
            posix.load_manifest(d / "step-00000001" / paths.MANIFEST)
        j3 = Job(dim=16)
        blob3 = _Blob()
        s3 = _snap(j3, d, snap_env.sub_job("disk"), extra={**j3.extra(), "blob": blob3})
        try:
            assert s3.restore_latest() == 3  # the forged data.bin "verifies": raw bytes only
            assert blob3.blob == payload
        finally:
            s3.close()
    assert not calls and not marker.exists()


def test_the_package_never_imports_a_deserialiser():
    """Static: no pickle/marshal/shelve/dill import, no torch.load / np.load(allow_pickle=True),
    no eval/exec anywhere in cudasnap (export.py writes a torch file for the user: torch.save)."""
    bad = []
    for f in PKG.rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cPickle", "_pickle", "marshal", "shelve",
                                           "dill", "cloudpickle", "joblib") for n in names):
                    bad.append(f"{f.name}:{node.lineno} import")
            if isinstance(node, ast.Call):
                fn = ast.unparse(node.func)
                if fn in ("eval", "exec", "torch.load", "pickle.loads", "pickle.load"):
                    bad.append(f"{f.name}:{node.lineno} {fn}()")
                if fn.endswith("np.load") or fn.endswith("numpy.load"):
                    kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    if kw.get("allow_pickle") != "False":
                        bad.append(f"{f.name}:{node.lineno} {fn} without allow_pickle=False")
    assert not bad, bad


# ---------------------------------------------------------- permissions

def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}


def test_files_0600_dirs_0700_arena_0600_under_umask_0(snap_env):
    old = os.umask(0)
    try:
        d = snap_env.tmp / "a" / "b" / "ckpt"
        j = Job(dim=16)
        s = _snap(j, d, snap_env.job, keep=1)
        for k in range(3):
            j.step()
            s.boundary(k)
            s.wait()
            s.flush()
        arena_mode = stat.S_IMODE(os.stat(snap_env.arena_path()).st_mode)
        s.close()
    finally:
        os.umask(old)
    assert arena_mode == 0o600
    modes = _modes(d)
    assert any(k.endswith("data.bin") for k in modes) and "latest" in modes
    for rel, mode in modes.items():
        want = 0o700 if (d / rel).is_dir() else 0o600
        assert mode == want, f"{rel}: {mode:o}"
    for p in (d, d.parent, d.parent.parent):  # the parents it had to create, too
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p


def test_group_writable_snapshot_loads_with_a_warning(snap_env, caplog):
    path, dig = _make(snap_env.dir, snap_env.job)
    os.chmod(path / paths.MANIFEST, 0o666)
    os.chmod(path, 0o777)
    with caplog.at_level("WARNING", logger="cudasnap"):
        start, j = _restore(snap_env.dir, snap_env.sub_job("r"))
    assert start == 2 and j.digests() == dig
    text = caplog.text
    assert f"{path / paths.MANIFEST} has mode 666" in text and f"{path} has mode 777" in text


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (os.chown)")


@needs_root
def test_snapshot_of_another_user_is_refused_unless_allowed(snap_env, monkeypatch):
    path, dig = _make(snap_env.dir, snap_env.job)
    for p in [snap_env.dir, *snap_env.dir.rglob("*")]:
        os.chown(p, FOREIGN_UID, FOREIGN_UID, follow_symlinks=False)
    monkeypatch.delenv(safe_io.FOREIGN_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"owned by uid {FOREIGN_UID}.*allow_foreign_owner"):
        _restore(snap_env.dir, snap_env.sub_job("r"))
    with pytest.raises(ConfigError, match=str(FOREIGN_UID)):
        posix.load_manifest(path / paths.MANIFEST)
    m = posix.load_manifest(path / paths.MANIFEST, allow_foreign_owner=True)
    (path / paths.DATA).chmod(0o600)
    posix.read_data(path, m, allow_foreign_owner=True)
    with pytest.raises(ConfigError, match=str(FOREIGN_UID)):
        posix.read_data(path, m)
    # The switch: the Snapshotter argument (once snapshotter.py passes it) or the environment.
    if "allow_foreign_owner" in inspect.signature(Snapshotter).parameters:
        start, j = _restore(snap_env.dir, snap_env.sub_job("a"), allow_foreign_owner=True)
        assert start == 2 and j.digests() == dig
    monkeypatch.setenv(safe_io.FOREIGN_ENV, "1")
    start, j = _restore(snap_env.dir, snap_env.sub_job("e"))
    assert start == 2 and j.digests() == dig


@needs_root
def test_staging_arena_of_another_user_or_world_writable_is_not_used(snap_env, caplog):
    """Disk holds step 0; the planted arena claims step 2: restore must come from disk."""
    C = native()
    d = snap_env.dir
    j = Job(dim=16)
    s = _snap(j, d, snap_env.job)
    for k in range(3):
        j.step()
        s.boundary(k)
        s.wait()
        if k == 0:
            s.flush()
    s.close(keep_arena=True)
    arena = snap_env.arena_path()
    for how in ("chown", "chmod"):
        planted = snap_env.shm / f"cudasnap-{snap_env.sub_job(how)}-r0.arena"
        shutil.copyfile(arena, planted)
        if how == "chown":
            os.chmod(planted, 0o600)
            os.chown(planted, FOREIGN_UID, FOREIGN_UID)
            want = f"owned by uid {FOREIGN_UID}"
        else:
            os.chmod(planted, 0o666)
            want = "writable by group/others"
        with pytest.raises(StagingError, match=want):
            C.Arena.open(str(planted), True)
        assert C.Arena.open(str(planted), False).num_slots == 3  # inspection works (2 + spare)
        caplog.clear()
        with caplog.at_level("WARNING", logger="cudasnap"):
            start, _ = _restore(d, snap_env.sub_job(how))
        assert start == 1, how  # step 0 from disk, not step 2 from the planted arena
        assert want in caplog.text
        planted.unlink(missing_ok=True)
    with pytest.raises(StagingError, match="cannot open staging arena.*symbolic links"):
        sl = snap_env.shm / f"cudasnap-{snap_env.sub_job('link')}-r0.arena"
        sl.symlink_to(arena)
        try:
            C.Arena.open(str(sl), False)
        finally:
            sl.unlink()


def test_arena_header_page_spare_bytes_are_not_trusted(snap_env):
    """Bytes past the CRC'd header (where the payload above was planted) feed nothing but
    the live-owner pid; a slot stays valid, and its data is what was committed."""
    C = native()
    a = C.Arena.create(str(snap_env.scratch_arena("x")), 2, 4096, 4096, 4096, "j", True)
    a.begin_write(0, 1, b'{"step":1}')
    a.commit(0, 1, 0)
    with open(snap_env.scratch_arena("x"), "r+b") as f:
        f.seek(L.AH_SIZE + 100)
        f.write(b"\xff" * 500)
    b = C.Arena.open(str(snap_env.scratch_arena("x")), False)
    assert b.slot_info(0)["valid"] and b.read_meta(0) == b'{"step":1}'
    del a, b


def test_incompatible_is_still_raised_for_a_foreign_shape(snap_env):
    """(Sanity) hostile-looking names that match nothing are IncompatibleSnapshot, not a path."""
    path, _ = _make(snap_env.dir, snap_env.job)

    def rename(m):
        for e in m["tensors"]:
            if e["group"].startswith("model:"):
                e["name"] = "../../" + e["name"]
    _rewrite_manifest(path, rename)
    with pytest.raises(IncompatibleSnapshot, match=r"'\.\./\.\./model"):
        _restore(snap_env.dir, snap_env.sub_job("r"))
