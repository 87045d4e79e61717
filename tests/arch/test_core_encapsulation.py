"""Issues 12, 24: the Snapshotter is a facade over cudasnap/core's components; no one
else reaches into it, and no component into another.

* each ``cudasnap.core`` module imports alone (no hidden order dependency, no
  import of the Snapshotter facade from below it);
* code outside ``cudasnap/core`` and ``snapshotter.py`` uses only public attributes of a
  Snapshotter (an AST check over ``snap._x`` / ``self._s._x`` / ``self.snapshotter._x``);
* inside it, each component owns its state: no shared-field hub (``core/shared.py``,
  mixins), no function taking the whole Snapshotter (``snap``), and no write of another
  object's attribute but the reviewed ones below (an AST check of every assignment);
* ``Flusher.final_flush`` works on the parts it is given (a failed write keeps the arena);
* the Snapshotter's environment is read through ``cudasnap.config.Settings``: a bad
  value is a ConfigError naming the variable, and keyword arguments win.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import parts
from torch import nn

import cudasnap
from cudasnap.core.counters import Counters
from cudasnap.core.flush import Flusher
from cudasnap.errors import ConfigError, SnapshotError

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "cudasnap"
CORE_MODULES = sorted(f"cudasnap.core.{p.stem}" for p in (PKG / "core").glob("*.py")
                      if p.stem != "__init__")


@pytest.mark.slow
@pytest.mark.parametrize("mod", ["cudasnap.core", *CORE_MODULES])
def test_core_module_imports_alone(mod: str) -> None:
    code = (f"import sys, {mod}\n"
            "assert 'cudasnap.snapshotter' not in sys.modules, 'imports the facade'\n"
            "assert 'cudasnap._C' not in sys.modules, 'loads the engine at import'\n"
            + ("assert 'torch' not in sys.modules, 'imports torch'\n"
               if mod == "cudasnap.core" else ""))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_core_init_is_one_line() -> None:
    assert (PKG / "core" / "__init__.py").read_text() == (
        '"""The mechanisms behind Snapshotter: state, layout, fences, staging, restore, '
        'timeline."""\n')


def _snapshotter_ref(node: ast.expr) -> bool:
    """``snap``, ``snapshotter``, ``self._s``, ``self.snap``, ``self.snapshotter``..."""
    if isinstance(node, ast.Name):
        return node.id in ("snap", "snapshotter")
    return isinstance(node, ast.Attribute) and node.attr in ("_s", "snap", "_snap", "snapshotter")


def private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__") and _snapshotter_ref(n.value)]


def test_private_use_finder_sees_the_old_adapter() -> None:
    old = "def arenas(self):\n    return [self._s._arena, snap._inherited, self.snap.flush()]\n"
    assert private_uses(ast.parse(old)) == [(2, "_arena"), (2, "_inherited")]


def test_nothing_outside_the_core_reaches_into_a_snapshotter() -> None:
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        if rel.parts[0] in ("core", "build") or rel.name == "snapshotter.py":
            continue
        bad += [f"{rel}:{line}: .{attr}" for line, attr in private_uses(ast.parse(f.read_text()))]
    assert not bad, "private Snapshotter fields used outside cudasnap/core:\n" + "\n".join(bad)


# Writes of an attribute of another object than ``self`` in cudasnap/core and the facade
# (the counters aside: plain data every component increments): (module, target) -> why.
REVIEWED_WRITES = {
    ("core/backend.py", "self.engine.wait_timeout_s"): "the native engine's setting, at birth",
    ("core/early.py", "early.boundary_event"): "EarlySaver's own field, from its module's "
                                               "_wait_next_boundary (kept a function for tests)",
    ("core/arena_keeper.py", "prep.warmed"): "the keeper hands its preparer the warmed inherited arena",
    ("core/copier.py", "self.state.step_values"): "boundary(step, **values) into the state",
    ("core/copier.py", "lay.arena_ok"): "the copier's cached 'fits' answer, kept per plan",
    ("snapshotter.py", "self.state.rng_sources"): "the rng_sources keyword",
    ("snapshotter.py", "self.state.restored_rng.again"): "the rng_restore keyword",
    ("core/state.py", "lt.owner"): "TrainingState's own LiveTensors",
    ("core/state.py", "lt.shard"): "TrainingState's own LiveTensors",
    ("core/state.py", "lt.tensor"): "TrainingState's own LiveTensors",
    ("core/apply.py", "p.grad"): "a restore leaves the registered models no gradients (issue 46)",
    ("core/file_copy.py", "e.partly_applied"): "a chunk failing its CRC after earlier ones were "
    "copied says so on the CorruptSnapshot it raises (issue 47: moved from storage.posix)",
}


def foreign_writes(tree: ast.AST) -> list[str]:
    """Targets ``x.attr = ...`` (also ``+=``, annotated, in tuples) whose ``x`` is not
    ``self``/``cls``, nor the counters (``self._counters``, or a local ``c`` alias)."""
    out = []
    for n in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            targets = list(n.targets)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        for t in [e for t in targets
                  for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]:
            if not isinstance(t, ast.Attribute):
                continue
            base = t.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls", "c"):
                continue
            if isinstance(base, ast.Attribute) and base.attr == "_counters" \
                    and isinstance(base.value, ast.Name) and base.value.id == "self":
                continue
            out.append(ast.unparse(t))
    return out


def test_foreign_write_finder_sees_a_reach_in() -> None:
    code = ("def f(self, keeper, c):\n    keeper.arena = None\n    self.x = c.y = 1\n"
            "    self._counters.skipped += 1\n    self._keeper.inherited = None\n")
    assert foreign_writes(ast.parse(code)) == ["keeper.arena", "self._keeper.inherited"]


def test_each_core_component_owns_its_state() -> None:
    assert not (PKG / "core" / "shared.py").exists(), "the shared-field hub is back"
    bad = []
    for f in sorted((PKG / "core").glob("*.py")) + [PKG / "snapshotter.py"]:
        rel = str(f.relative_to(PKG))
        tree = ast.parse(f.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and (n.name.endswith("Mixin") or n.name == "Fields"):
                bad.append(f"{rel}:{n.lineno}: class {n.name} (state shared through a base)")
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bad += [f"{rel}:{n.lineno}: {n.name}({a.arg}) takes the whole Snapshotter"
                        for a in n.args.args + n.args.kwonlyargs
                        if a.arg in ("snap", "snapshotter")]
        bad += [f"{rel}: writes {t}" for t in foreign_writes(tree)
                if (rel, t) not in REVIEWED_WRITES]
    assert not bad, "\n".join(bad)


class _Arena:
    """An arena whose newest COMPLETE slot holds step 3."""
    path = "/dev/shm/fake"

    def __init__(self) -> None:
        self.leases: list[int] = []

    def newest_complete(self) -> int:
        return 1

    def slot_info(self, slot: int) -> dict:
        return {"step": 3, "data_bytes": 8}

    def lease(self, slot: int) -> None:
        self.leases.append(slot)

    def release(self, slot: int) -> None:
        self.leases.remove(slot)


class _Keeper:
    def __init__(self, arenas: list) -> None:
        self.arenas = arenas

    def staged_arenas(self) -> list:
        return self.arenas


class _Copier:
    slot_lock = threading.RLock()

    def __init__(self) -> None:
        self.calls: list[str] = []

    def wait_job(self, timeout: float | None = None) -> bool:
        self.calls.append("wait_job")
        return True

    def copy_live(self, timeout: float | None) -> None:
        self.calls.append("copy_live")


class _Storage:
    def __init__(self, fail: bool, stored: set[int]) -> None:
        self.fail, self.stored, self.written = fail, stored, []

    def has_step(self, step: int) -> bool:
        return step in self.stored

    def write_slot(self, arena, slot, threads, keep, timeout=None):
        if self.fail:
            raise SnapshotError("disk full")
        self.written.append(slot)
        return Path("/x/3"), {"step": 3, "seconds": 0.1}


def _flusher(arenas: list, storage: _Storage) -> tuple[Flusher, _Copier]:
    cp = _Copier()
    return Flusher(storage, _Keeper(arenas), cp, Counters(), threading.RLock(),  # type: ignore[arg-type]
                   keep=2, flush_threads=1), cp


def test_final_flush_writes_the_newest_step_once_and_keeps_the_arena_on_failure(caplog) -> None:
    """close()'s final flush, on injected parts: nothing to do without an arena; the newest
    slot is leased, written and released (the live state settled first); a step already
    stored is not written again; a failed write returns False (close() keeps the arena)."""
    f, _ = _flusher([], _Storage(fail=True, stored=set()))
    assert f.final_flush() is True
    arena, ok = _Arena(), _Storage(fail=False, stored=set())
    f, cp = _flusher([arena], ok)
    assert f.final_flush() is True and ok.written == [1] and arena.leases == []
    assert cp.calls == ["wait_job", "wait_job", "copy_live"] and f.flushed_step == 3
    assert f.final_flush() is True and ok.written == [1]  # step 3 was this process's flush
    stored = _Storage(fail=False, stored={3})
    f, _ = _flusher([arena], stored)
    assert f.final_flush() is True and stored.written == []  # already in the storage
    f, _ = _flusher([arena], _Storage(fail=True, stored=set()))
    assert f.final_flush() is False and arena.leases == []
    assert "final flush failed" in caplog.text and "/dev/shm/fake" in caplog.text


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    m = nn.Linear(4, 4)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("name,value", [("CUDASNAP_WAIT_S", "soon"), ("CUDASNAP_HEALTH", "maybe"),
                                        ("CUDASNAP_ARENA_SYNC_MAX_BYTES", "lots"),
                                        ("RANK", "first")])
def test_bad_environment_is_a_config_error_naming_it(snap_env, monkeypatch, name, value) -> None:
    monkeypatch.setenv(name, value)
    m, opt = _model()
    with pytest.raises(ConfigError) as ei:
        cudasnap.Snapshotter(m, opt, snap_env.dir, backend="cpu")
    assert name in str(ei.value) and repr(value) in str(ei.value)


def test_environment_is_read_and_keyword_arguments_win(snap_env, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CUDASNAP_WAIT_S", "7")
    monkeypatch.setenv("CUDASNAP_SHM_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("CUDASNAP_DIR", str(tmp_path / "env-dir"))
    m, opt = _model()
    with cudasnap.Snapshotter(m, opt, backend="cpu", shm_dir="/dev/shm",
                              flush_on_close=False) as snap:
        assert snap.wait_timeout_s == 7.0                        # from the environment
        assert parts.copier(snap).wait_timeout_s == 7.0                # what the fences use
        with pytest.raises(AttributeError):                      # not silently ignored
            snap.wait_timeout_s = 1.0  # type: ignore[misc]
        assert snap.job == snap_env.job                          # CUDASNAP_JOB
        assert Path(snap.directory) == tmp_path / "env-dir"      # CUDASNAP_DIR
        assert snap.arena_path.parent == Path("/dev/shm")        # the keyword wins
    monkeypatch.setenv("CUDASNAP_HEALTH", "1")
    with cudasnap.Snapshotter(m, opt, snap_env.dir, backend="cpu", health=False, job="kw-" +
                              snap_env.job, flush_on_close=False) as snap:
        assert snap.guard is None and snap.job == "kw-" + snap_env.job


def test_public_plan_and_staging_facts_replace_private_fields(snap_env) -> None:
    """What bench/gpu_bench.py used to read from ``snap._layout`` / ``_cuda`` / ``_arena``."""
    m, opt = _model()
    with cudasnap.Snapshotter(m, opt, snap_env.dir, backend="cpu", flush_on_close=False) as snap:
        assert snap.stats()["layout"] is None and snap.staged_arenas() == []
        snap.boundary(0)
        assert snap.wait(60)
        lay = snap.stats()["layout"]
        assert lay["tensors"] == 2 and lay["copy_ranges"] >= 1  # weight, bias (SGD: no state)
        assert lay["allocator_tracking"] is False and snap.copy_stream_handle() is None
        (arena,) = snap.staged_arenas()
        assert arena.slot_info(arena.newest_complete())["step"] == 0
