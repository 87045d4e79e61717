"""Restore: find the candidates (shared-memory slots, committed snapshots), load, roll back.

``restore_latest()`` tries every candidate newest step first: this node's
arena slots (validated: manifest, then each chunk's CRC32C) and the storage's
committed snapshots; a corrupt or torn one is skipped with a warning naming it.
``rollback()`` copies the newest COMPLETE slot back in the same process.

Call order: the facade makes the ``Restorer`` and calls :meth:`Restorer.attach` once
the triggers exist; its ``restore_latest()`` / ``rollback()`` check that it is open,
then call these. Each first waits for the running copy (``Copier.wait_job``), holds
the background arena set-up (``ArenaPreparer.paused``) while it reads, tells the
copier to forget the live state (``Copier.forget_live``) before it writes the state,
then records the step (``Timeline.restored_at``) and drops the plan
(``Layouts.invalidate``). The coordinator (``cudasnap.distributed``, through
``cudasnap.distributed.local``) calls ``restore_slot`` / ``restore_dir`` / ``record_restore``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from .. import storage as storages
from .._native import native
from ..errors import CorruptSnapshot, SnapshotError
from ..format import manifest as fmt
from ..format import run_notes
from ..format.manifest import validate_manifest
from ..storage.progress import bytes_read, io_progress
from .timeline import resume_message

if TYPE_CHECKING:
    from cudasnap._C import Arena, FileReadAhead

    from ..format.manifest import TensorEntry
    from ..storage.listing import StoredSnapshot
    from ..storage.protocol import Storage
    from ..storage.remote_base import RemoteSnapshot
    from .arena_keeper import ArenaKeeper
    from .copier import Copier
    from .counters import Counters
    from .options import Options
    from .plan_cache import Layouts
    from .state import TrainingState
    from .timeline import Timeline
    from .types import SnapshotFile

log = logging.getLogger("cudasnap")


class Coordinated(Protocol):
    """The coordinator of a multi-rank restore (``cudasnap.distributed.coordinator``)."""

    def restore(self) -> int: ...


class Pausable(Protocol):
    """The health guard (``cudasnap.triggers.guard``): hang detection paused in a block."""

    def paused(self) -> AbstractContextManager[None]: ...


class _Verify:
    """``fn(*args)`` (verify_buffer) on its own thread; ``result()`` waits for it."""

    def __init__(self, fn: Callable[..., int], *args: object) -> None:
        self._out: int | None = None
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True,
                                        name="cudasnap-verify")
        self._thread.start()

    def _run(self, fn: Callable[..., int], args: tuple[object, ...]) -> None:
        try:
            self._out = fn(*args)
        except BaseException as e:  # handed to the caller by result()
            self._err = e

    def join(self) -> None:
        self._thread.join()

    def result(self) -> int:
        self._thread.join()
        if self._err is not None:
            raise self._err
        assert self._out is not None
        return self._out


class Restorer:
    def __init__(self, state: TrainingState, storage: Storage, keeper: ArenaKeeper, copier: Copier,
                 layouts: Layouts, timeline: Timeline, counters: Counters, opts: Options) -> None:
        self.state, self.storage, self._keeper, self._copier = state, storage, keeper, copier
        self._layouts, self._timeline, self._counters = layouts, timeline, counters
        self.rank, self.flush_threads, self.wait_timeout_s = opts.dist.rank, opts.flush.threads, opts.waits.copy_s
        self.allow_foreign_owner = opts.flush.allow_foreign_owner
        self.require_resume = opts.flush.require_resume
        self.partly_applied: str | None = None  # a snapshot that failed half-way through
        self._resume_logged = False
        self._dist: Coordinated | None = None
        self._guard: Pausable | None = None

    def attach(self, dist: Coordinated | None, guard: Pausable | None) -> None:
        """After the triggers exist: the coordinator (multi-rank restores) and the guard
        (paused during a rollback)."""
        self._dist, self._guard = dist, guard

    def restore_latest(self) -> int:
        """Loads the newest snapshot that verifies; returns the step to resume at (0 if none).

        Sources, newest step first: this node's shared-memory slot (fastest),
        then committed snapshots on disk. A corrupt or torn candidate is skipped
        with a warning naming it; a snapshot that does not fit the live
        model/optimizer raises IncompatibleSnapshot.
        """
        self._copier.wait_job(self.wait_timeout_s)
        t0 = time.perf_counter()
        c = self._counters
        if self._dist is not None:
            self.partly_applied = None
            nxt = self._dist.restore()
            if nxt:
                self._timeline.restored_at(nxt - 1)
            r = c.restore or {}
            r["seconds"] = time.perf_counter() - t0
            c.restore = r if nxt else {"source": None, "step": None, "seconds": r["seconds"],
                                       "where": None}
            self._layouts.invalidate()
            if nxt:
                log.info("rank %d restored step %d from %s", self.rank, nxt - 1, r.get("source"))
                if not self._resume_logged:
                    self._resume_logged = True
                    src, where = cast("str | None", r.get("source")), cast("str | None", r.get("where"))
                    log.warning("rank %d: %s", self.rank, resume_message(nxt - 1, src, where))
            else:
                self._refuse_partly_applied()
                self._starting_over(getattr(self._dist, "lost", None))
            return nxt
        # (step, order among a step's copies, source, slot or stored snapshot)
        candidates: list[tuple[int, int, str, int | StoredSnapshot | RemoteSnapshot]] = []
        self.partly_applied = None
        arenas = self._keeper.staged_arenas()
        arena: Arena | None = arenas[0] if arenas else None
        if arena is not None:
            for slot in range(arena.num_slots):  # every COMPLETE slot: the older one too
                info = arena.slot_info(slot)
                if info["valid"]:
                    candidates.append((info["step"], 1 + info["seq"], "shm", slot))
                elif info["problem"]:  # COMPLETE-looking but damaged: say so, never load it
                    log.warning("skipping snapshot %s slot %d: %s", arena.path, slot,
                                info["problem"])
        for s in self.storage.list_snapshots():
            candidates.append((s.step, 0, "disk", s))
        candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
        for _step, _, source, ref in candidates:
            try:
                if source == "shm":  # a slot of ``arena`` (listed only when there is one)
                    shm, slot = cast("Arena", arena), cast(int, ref)
                    where = f"{shm.path} slot {slot}"
                    got = self.restore_slot(shm, slot, where)
                else:
                    snap = cast("StoredSnapshot | RemoteSnapshot", ref)
                    where = str(snap.path)
                    got = self.restore_dir(snap)
            except CorruptSnapshot as e:
                log.warning("skipping snapshot %s: %s", where, e)
                continue
            secs = time.perf_counter() - t0
            c.restore = {"source": source, "step": got, "seconds": secs, "where": where}
            log.info("restored step %d from %s (%s) in %.3f s", got, source, where, secs)
            if not self._resume_logged:
                self._resume_logged = True
                log.warning("%s", resume_message(got, source, where))
            self._timeline.restored_at(got)
            self._layouts.invalidate()
            return got + 1
        c.restore = {"source": None, "step": None, "seconds": 0.0, "where": None}
        self._refuse_partly_applied()
        self._starting_over(None)
        return 0

    def _starting_over(self, lost: str | None) -> None:
        """Nothing restored: never a silent step 0 when the job made progress (issue 35).
        ``lost``: what the ranks' vote saw in memory and could not assemble. Logged at
        ERROR; SnapshotError with ``require_resume``."""
        seen = "; ".join(x for x in (lost, self.storage.progress_evidence()) if x)
        if not seen:
            return  # a fresh job
        msg = (f"rank {self.rank}: starting over at step 0, although the job made progress "
               f"that cannot be restored: {seen}")
        if self.require_resume:
            raise SnapshotError(msg + " (require_resume / CUDASNAP_REQUIRE_RESUME refuses to "
                                "start over; pass fresh=True to start over on purpose)")
        log.error("%s (require_resume=True or CUDASNAP_REQUIRE_RESUME=1 refuses instead)", msg)
        run_notes.started_over(msg)  # cudasnap run's summary says so

    def _refuse_partly_applied(self) -> None:
        """Nothing was restored: CorruptSnapshot if a snapshot failed half-way through being
        applied (a malformed host state, or a chunk of data.bin failing its CRC32C after
        earlier ones were copied), since the live state is then no longer the initial one."""
        if self.partly_applied:
            raise CorruptSnapshot(
                f"no snapshot could be restored, and {self.partly_applied} failed half-way "
                "through being applied: the live model/optimizer are no longer in their "
                "initial state; remove that snapshot and rebuild them before training")

    def _apply(self, tensors: list[TensorEntry], host: dict[str, object],
               data: torch.Tensor | SnapshotFile, where: str,
               before_copy: Callable[[], None] | None = None) -> int:
        """state.apply, with a malformed (CRC-consistent but hostile) host state reported
        as CorruptSnapshot instead of a raw KeyError/TypeError crashing restore."""
        self._copier.forget_live()  # the live state is about to be replaced: no JIT copy of it
        try:
            return self.state.apply(tensors, host, data, where, before_copy, self.wait_timeout_s)
        except SnapshotError as e:
            if getattr(e, "partly_applied", False):  # a chunk failed after earlier ones were
                self.partly_applied = where          # copied (core.file_copy)
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
            self.partly_applied = where
            raise CorruptSnapshot(
                f"{where}: malformed snapshot state ({type(e).__name__}: {e})") from e

    def restore_dir(self, ref: Path | StoredSnapshot | RemoteSnapshot) -> int:
        """Applies a stored snapshot; returns its step. ``ref``: a snapshot of
        ``self.storage``'s listing, or a local step/rank directory (``storages.local_snapshot``:
        a multi-rank one loads only when its state is replicated)."""
        if isinstance(ref, Path):
            ref = storages.local_snapshot(ref)
        elif storages.is_local(ref):
            ref = storages.local_snapshot(cast(Path, ref.path), ref.step)
        # The background arena set-up (pre-faulting every slot) would take the cores, the
        # memory bandwidth and the mmap lock from the read, the CRC check and the copy:
        # held for the restore, as restore_slot does (issue 26: 0.51x -> ~0.9x torch.load).
        # data.bin's head is read beside the manifest's parse and the copy's planning.
        with self._keeper.prep.paused():
            ahead = self.storage.read_ahead(ref, self.allow_foreign_owner)
            try:
                return self._restore_dir(ref, ahead)
            finally:  # stops the reader however the restore ends (the DataFile does too)
                if ahead is not None:
                    ahead.release()

    def _restore_dir(self, ref: StoredSnapshot | RemoteSnapshot, ahead: FileReadAhead | None) -> int:
        manifest = self.storage.load_manifest(ref, allow_foreign_owner=self.allow_foreign_owner)
        name = str(ref.path).rstrip("/").rsplit("/", 1)[-1]
        with io_progress(int(manifest["data"]["bytes"]), f"cudasnap restore {name}", bytes_read):
            data = self.storage.open_data(ref, manifest, self.flush_threads,
                                          allow_foreign_owner=self.allow_foreign_owner, ahead=ahead)
            try:
                return self._apply(manifest["tensors"], manifest["host"], data, str(ref.path))
            finally:  # apply closes a file it read; also when it fails before that
                close = getattr(data, "close", None)
                if close is not None:
                    close()

    def restore_slot(self, arena: Arena, slot: int, where: str) -> int:
        """Applies an arena slot (validated first); returns its step.

        The chunks' CRC32C check runs on its own thread (native, GIL released) while
        the state is checked and the copy planned; no byte is copied before it passed,
        and a slot failing it is reported as damaged whatever else was found first.
        A background arena set-up (the pre-fault of an adopted arena) is held for the
        duration: it would take cores and the mmap lock from the check and the copy.
        """
        with self._keeper.prep.paused():
            return self._restore_slot(arena, slot, where)

    def _restore_slot(self, arena: Arena, slot: int, where: str) -> int:
        info = arena.slot_info(slot)
        nbytes = info["data_bytes"]
        if nbytes > arena.data_capacity:  # never read past the slot (slot_info says so too)
            raise CorruptSnapshot(f"{where}: {nbytes} data bytes exceed the slot capacity "
                                  f"{arena.data_capacity}")
        crcs = arena.read_table(slot)
        C = native()
        arena.lease(slot)
        check: _Verify | None = None
        try:
            # The CRC32C pass starts first: the manifest is parsed and checked beside it.
            check = _Verify(C.verify_buffer, arena.data_ptr(slot), nbytes, arena.chunk_bytes,
                            crcs, self.flush_threads)

            def verified() -> None:
                bad = check.result()
                if bad >= 0:
                    raise CorruptSnapshot(f"{where}: chunk {bad} fails its CRC32C")

            was = self.partly_applied
            try:
                meta = fmt.parse_slot_meta(arena.read_meta(slot), where)
                meta["data"] = fmt.data_section(nbytes, arena.chunk_bytes, crcs)
                validate_manifest(meta, where)
                data = torch.frombuffer(arena.data_view(slot, nbytes), dtype=torch.uint8) \
                    if nbytes else torch.empty(0, dtype=torch.uint8)
                return self._apply(meta["tensors"], meta["host"], data, where, verified)
            except BaseException:
                if check.result() >= 0:  # nothing was copied: the damage is the news
                    self.partly_applied = was
                    verified()
                raise
        finally:
            if check is not None:
                check.join()  # never release the slot while the check still reads it
            arena.release(slot)

    def newest_known_step(self) -> int:
        """Newest step in shared memory or on disk, or -1 (no validation of the data)."""
        best = -1
        for a in self._keeper.staged_arenas():
            if a.newest_complete() >= 0:
                best = max(best, a.slot_info(a.newest_complete())["step"])
        snaps = self.storage.list_snapshots()
        return max(best, snaps[0].step if snaps else -1)

    def rollback(self) -> int:
        """In-process rollback: copy the newest COMPLETE slot back into the live tensors.

        For a fault the process survives (a NaN loss, a peer failure): training
        continues at the returned step (snapshot step + 1).
        """
        self._copier.wait_job(self.wait_timeout_s)
        arena = self._keeper.arena
        if arena is None or arena.newest_complete() < 0:
            raise SnapshotError("rollback(): no COMPLETE snapshot in memory yet")
        slot = arena.newest_complete()
        guard = self._guard
        with guard.paused() if guard is not None else contextlib.nullcontext():
            step = self.restore_slot(arena, slot, f"{arena.path} slot {slot}")
        self._timeline.restored_at(step)
        return step + 1

    def record_restore(self, source: str, step: int, where: str) -> None:
        """Notes where a restore came from (``stats()["restore"]``; the coordinator's vote)."""
        self._counters.restore = {"source": source, "step": step, "where": where}

    def last_restore(self) -> dict[str, object] | None:
        """What the last restore loaded: source, step, where (None before any)."""
        return self._counters.restore
