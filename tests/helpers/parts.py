"""A test's reach into the package's private parts: the components a ``Snapshotter`` owns
(``cudasnap/core/wiring.py``), their insides, module-private functions and tables, and the
compiled engine's test-only entry points.

This is the one file of tests/ that names a private attribute of cudasnap
(tests/arch/test_private_reach.py): the facade keeps no views of its components' state for
tests, so a test that must see, stall or replace one part goes through a function here, and
what the tests reach is written in one place. The first ones:

- ``arena(snap)``: ``snap._keeper.arena``, this rank's staging arena (None before one exists)
- ``prep(snap)``: ``snap._keeper.prep``, the background arena set-up (``ArenaPreparer``)
- ``cuda(snap)``: ``snap._backend.cuda``, the ``CudaBackend`` (None on the CPU backend)
- ``engine(snap)``: ``snap._backend.engine``, the copy engine
- ``job(snap)``: ``snap._copier.job``, the running copy (None: none)
- ``layout(snap)``: ``snap._layouts.layout``, the current ``Layout`` (None: to be rebuilt)
- ``partly_applied(snap)``: ``snap._restorer.partly_applied``, a snapshot a restore left
  half-applied (None: none)
- ``set_rescan_every(snap, n)``: ``snap._layouts.rescan_every = n``
- ``swap_engine(snap, new)``: ``new`` in place of the engine (the ``Backend``'s and the
  ``CudaBackend``'s); returns the one it replaced

Then the components themselves (``copier``, ``keeper``, ``layouts``, ``restorer``), what a
test wraps or replaces (``layout_build``/``replace_layout_build``, ``replace_check_trust``...),
module-private functions and tables under unit test (``itemsize``, ``copy_back_kinds``,
``inprocess_alive``...) and the engine's test hooks (``crc32c_impl``, ``arm_native_hook``...).

Prefer the public API where it says the same thing (``snap.staged_arenas()``,
``snap.stats()``, ``snap.copy_stream_handle()``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def arena(snap: Any) -> Any:
    """The arena the copies go to (None before the first boundary made it)."""
    return snap._keeper.arena


def prep(snap: Any) -> Any:
    """The background arena set-up (``cudasnap.core.arena_preparer.ArenaPreparer``)."""
    return snap._keeper.prep


def cuda(snap: Any) -> Any:
    """The ``CudaBackend`` (None on the CPU backend and before the first boundary)."""
    return snap._backend.cuda


def engine(snap: Any) -> Any:
    """The copy engine (None before the first boundary)."""
    return snap._backend.engine


def job(snap: Any) -> Any:
    """The running copy job (None: none submitted, or forgotten after a wait)."""
    return snap._copier.job


def layout(snap: Any) -> Any:
    """The current ``Layout`` (None: rebuilt at the next boundary)."""
    return snap._layouts.layout


def partly_applied(snap: Any) -> str | None:
    """The snapshot a restore failed half-way through (None: none)."""
    return snap._restorer.partly_applied


def set_rescan_every(snap: Any, n: int) -> None:
    """A full re-scan of the state every ``n`` x ceil(tensors / 1024) boundaries."""
    snap._layouts.rescan_every = n


def swap_engine(snap: Any, new: Any) -> Any:
    """Puts ``new`` in place of the copy engine (after the first boundary made one); returns
    the engine it replaced. The Copier, the keeper and the layouts read the engine from the
    ``Backend`` at each call, so the next boundary submits to ``new``; on the CUDA backend
    the ``CudaBackend`` holds it too and is changed alike."""
    b = snap._backend
    old = b.engine
    b.engine = new
    if b.cuda is not None:
        b.cuda.engine = new
    return old


# --- the components themselves (their public methods and fields are the test's to use) ---


def copier(snap: Any) -> Any:
    """The ``Copier`` (its ``fence``, ``wait_timeout_s``)."""
    return snap._copier


def keeper(snap: Any) -> Any:
    """The arena keeper (``ensure``, ``create_arena``)."""
    return snap._keeper


def layouts(snap: Any) -> Any:
    """The ``Layouts`` (``building``, ``dropped``, ``draining``, ``running``)."""
    return snap._layouts


def restorer(snap: Any) -> Any:
    """The ``Restorer`` (``attach``)."""
    return snap._restorer


def restore_slot(snap: Any) -> Callable[..., Any]:
    """The restorer's restore of one arena slot (bound method)."""
    return snap._restorer._restore_slot


def replace_restore_slot(monkeypatch: Any, snap: Any, fn: Callable[..., Any]) -> None:
    monkeypatch.setattr(snap._restorer, "_restore_slot", fn)


def prep_paused(snap: Any) -> Any:
    """The background arena set-up is held (a restore pauses it)."""
    return snap._keeper.prep._cancel.paused


def prep_thread(snap: Any) -> Any:
    """The background arena set-up's thread (None: not started)."""
    return snap._keeper.prep._thread


# --- methods and module functions a test wraps or replaces (``real``, then a spy) ---


def _layouts_cls() -> Any:
    from cudasnap.core.plan_cache import Layouts
    return Layouts


def layout_build(now: bool = False) -> Callable[..., Any]:
    """``Layouts``' build of a layout (``now``: the one on the step's thread)."""
    return getattr(_layouts_cls(), "_build_layout_now" if now else "_build_layout")


def replace_layout_build(fn: Callable[..., Any], monkeypatch: Any = None, now: bool = False) -> None:
    """``fn`` in place of ``layout_build(now)`` (through ``monkeypatch`` when given; else set
    plainly, and the test puts the real one back)."""
    name = "_build_layout_now" if now else "_build_layout"
    if monkeypatch is None:
        setattr(_layouts_cls(), name, fn)
    else:
        monkeypatch.setattr(_layouts_cls(), name, fn)


def abandoned_fences() -> list[Any]:
    """``plan_cache``'s list of copies abandoned with their storages held (mutable)."""
    from cudasnap.core import plan_cache
    return plan_cache._ABANDONED


def apply_state() -> Callable[..., Any]:
    from cudasnap.core import apply
    return apply._apply_state


def replace_apply_state(monkeypatch: Any, fn: Callable[..., Any]) -> None:
    from cudasnap.core import apply
    monkeypatch.setattr(apply, "_apply_state", fn)


def replace_restorer_apply(monkeypatch: Any, fn: Callable[..., Any]) -> None:
    """``fn`` in place of ``Restorer._apply`` (every Restorer)."""
    from cudasnap.core.restore import Restorer
    monkeypatch.setattr(Restorer, "_apply", fn)


def verify_class() -> Any:
    """``core/restore.py``'s verifier of the chunks read (a test subclasses it)."""
    from cudasnap.core import restore
    return restore._Verify


def replace_verify_class(monkeypatch: Any, cls: Any) -> None:
    from cudasnap.core import restore
    monkeypatch.setattr(restore, "_Verify", cls)


def wait_next_boundary() -> Callable[..., Any]:
    from cudasnap.core import early
    return early._wait_next_boundary


def replace_wait_next_boundary(monkeypatch: Any, fn: Callable[..., Any]) -> None:
    from cudasnap.core import early
    monkeypatch.setattr(early, "_wait_next_boundary", fn)


def check_trust(*args: Any) -> None:
    """``safe_io``'s refusal of a file or directory it must not trust."""
    from cudasnap.storage import safe_io
    safe_io._check_trust(*args)


def replace_check_trust(monkeypatch: Any, fn: Callable[..., Any]) -> None:
    """``fn`` in place of the trust check the POSIX storage calls."""
    from cudasnap.storage import posix
    monkeypatch.setattr(posix, "_check_trust", fn)


def remote_latest_read() -> Callable[..., Any]:
    from cudasnap.storage import remote_latest
    return remote_latest._read


def replace_remote_latest_read(monkeypatch: Any, fn: Callable[..., Any]) -> None:
    from cudasnap.storage import remote_latest
    monkeypatch.setattr(remote_latest, "_read", fn)


def cuda_in_use() -> bool:
    """The NVML trigger's test of a CUDA context in this process."""
    from cudasnap.triggers import nvml
    return nvml._cuda_in_use()


def replace_cuda_in_use(monkeypatch: Any, fn: Callable[[], bool]) -> None:
    from cudasnap.triggers import nvml
    monkeypatch.setattr(nvml, "_cuda_in_use", fn)


def reset_nvml_warning(monkeypatch: Any) -> None:
    """The NVML trigger warns again that NVML is unavailable."""
    from cudasnap.triggers import nvml
    monkeypatch.setattr(nvml, "_warned_unavailable", False)


def clear_fault_points(monkeypatch: Any) -> None:
    """No hook at any fault point (``cudasnap._points``)."""
    from cudasnap import _points
    monkeypatch.setattr(_points, "_hooks", {})


def library_path(native_mod: Any = None) -> str:
    """The compiled engine's file, as ``cudasnap._native`` finds it."""
    if native_mod is None:
        from cudasnap import _native as native_mod
    return native_mod._library_path()


def replace_library_path(monkeypatch: Any, native_mod: Any, fn: Callable[[], str]) -> None:
    monkeypatch.setattr(native_mod, "_library_path", fn)


def titan_save() -> Callable[..., Any]:
    """``CudaSnapCheckpointManager._save`` (torchtitan's save step, cudasnap's manager)."""
    from cudasnap.integrations.torchtitan import CudaSnapCheckpointManager
    return CudaSnapCheckpointManager._save


def set_titan_save(fn: Callable[..., Any]) -> None:
    from cudasnap.integrations.torchtitan import CudaSnapCheckpointManager
    CudaSnapCheckpointManager._save = fn  # type: ignore[method-assign]


# --- module-private functions and tables under unit test ---


def copy_back_kinds() -> tuple[Any, Any]:
    """``copy_back``'s (dtype table, plain tensor kinds): what ``plan_pairs`` takes."""
    from cudasnap.core import copy_back
    return copy_back._dtypes(), copy_back._PLAIN


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype name."""
    from cudasnap.format import manifest
    return manifest._ITEMSIZE[dtype]


def check_tensors(*args: Any) -> Any:
    from cudasnap.format import manifest
    return manifest._check_tensors(*args)


def tensors_sound(*args: Any) -> bool:
    from cudasnap.format import manifest
    return manifest._tensors_sound(*args)


def codec_tags() -> Any:
    """The tags ``codec`` gives a host value's non-JSON types."""
    from cudasnap.format import codec
    return codec._TAGS


def compact_dumps(value: Any) -> str:
    """``codec``'s compact JSON encoder (the one ``codec.dumps`` uses)."""
    from cudasnap.format import codec
    return codec._COMPACT(value)


def cuda_spans(*args: Any) -> Any:
    from cudasnap._cuda import _spans
    return _spans(*args)


def host_changed(ht: Any) -> dict[str, bool]:
    """A ``HostText``'s sources changed since it last looked: {source: changed}."""
    mask = ht._hw.changed()
    return {src: bool(mask >> bit & 1) for src, bit in ht._bit.items()}


def host_optim_text(ht: Any) -> Any:
    """A ``HostText``'s cached optimizer text (None: to be encoded again)."""
    return ht._optim


def host_watched(ht: Any) -> set[str]:
    """The sources a ``HostText`` watches natively."""
    return set(ht._watch)


def inprocess_propose(ipr: Any, *args: Any) -> bool:
    return ipr._propose(*args)


def inprocess_alive(ipr: Any, *args: Any) -> bool:
    return ipr._alive(*args)


def inprocess_joined(ipr: Any, *args: Any) -> Any:
    return ipr._joined(*args)


def inprocess_release(ipr: Any, *args: Any) -> Any:
    return ipr._release(*args)


def set_inprocess_attempt(ipr: Any, gen: int) -> None:
    """The in-process restart's attempt generation."""
    ipr._attempt_gen = gen


def vote_restore_step(vote: Any, *args: Any) -> Any:
    """``RestoreVote``'s restore of an agreed step."""
    return vote._restore_step(*args)


def vote_check_world(vote: Any, *args: Any) -> Any:
    """``RestoreVote``'s check of the snapshot's world against this one."""
    return vote._check_world(*args)


def remote_host() -> str:
    from cudasnap.storage import remote_ranks
    return remote_ranks._host()


def read_verdict(path: Any) -> Any:
    """The supervisor's reading of a child's verdict file."""
    from cudasnap.supervisor import child
    return child._read_verdict(path)


def no_wait_kinds() -> Any:
    """The trigger kinds whose flush does not wait for the GPU's copy (``guard``)."""
    from cudasnap.triggers import guard
    return guard._NO_WAIT


def shards_assemble(*args: Any, **kw: Any) -> Any:
    from cudasnap.tools import shards
    return shards._assemble(*args, **kw)


def shards_chunks(*args: Any, **kw: Any) -> Any:
    from cudasnap.tools import shards
    return shards._chunks(*args, **kw)


def metrics_thread(server: Any) -> Any:
    """The /metrics server's thread."""
    return server._thread


def auto_reset(monkeypatch: Any, state: bool = True) -> None:
    """Transparent mode (``tools/auto.py``) with no hook installed (and, with ``state``, no
    state gathered yet)."""
    from cudasnap.tools import auto
    monkeypatch.setattr(auto, "_handle", None)
    if state:
        monkeypatch.setattr(auto, "_state", {})


def auto_post_step(*args: Any) -> Any:
    from cudasnap.tools import auto
    return auto._post_step(*args)


def auto_health() -> Any:
    from cudasnap.tools import auto
    return auto._health


def auto_owning_modules(*args: Any) -> Any:
    from cudasnap.tools import auto
    return auto._owning_modules(*args)


def auto_live_modules() -> Any:
    from cudasnap.tools import auto
    return auto._live_modules()


# --- the compiled engine's test-only entry points ---


def crc32c_impl(C: Any, *args: Any) -> int:
    """CRC32C of ``(data, impl[, crc])`` by one implementation (``portable``, ``sse42``...)."""
    return C._crc32c_impl(*args)


def arm_native_hook(C: Any, *args: Any) -> None:
    """Arms the engine's test hook ``(name, phase[, nth])``."""
    C._arm_test_hook(*args)


def armed_kill_phase(C: Any) -> str:
    return C._armed_kill_phase()


def native_kill_phases(C: Any) -> list[str]:
    return C._test_kill_phases()


def flush_active_add(C: Any, delta: int) -> None:
    """Counts a flush in (1) or out (-1) of the engine's ``flush_active``."""
    C._test_flush_active_add(delta)


def raise_native(C: Any, kind: int, msg: str) -> None:
    """The engine raises its error of ``kind``."""
    C._raise_for_test(kind, msg)
