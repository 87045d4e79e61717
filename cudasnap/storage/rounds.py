"""What one distributed flush round writes (``cudasnap.distributed.flush_round``), on disk or in a store.

``round_store(directory)``: the rank's directory (``LocalSnapshots.directory``) is a local
snapshot directory (``PosixRounds``), or the state directory of an object-store URL
(``RemoteRounds``: ``storage.fsspec.state_dir`` records the URL it stands for). Both
follow the same protocol: each rank writes ``step-N/rank-R/``, the committer checks
which ranks' parts are present and writes ``COMMIT``, then ``latest``, then prunes.

Call order: ``flush_round.FlushRounds`` opens the store once, then per round
``clear_stale`` and ``write_rank`` (each writer), ``present`` and ``commit`` (the
committer), ``refresh`` (every rank after a committed round), ``committed_with``
(``final_step`` at close).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..format.paths import COMMIT, MANIFEST, rank_dirname, step_dirname
from . import posix
from .remote_base import url_of_state_dir

if TYPE_CHECKING:
    from cudasnap._C import Arena

    from .fsspec import FsspecStorage

log = logging.getLogger("cudasnap.distributed")


class RoundStore(Protocol):
    where: str

    def clear_stale(self, step: int, rank: int) -> None:
        """Removes ``rank``'s part of an uncommitted ``step`` (a failed round's)."""

    def write_rank(self, arena: Arena, slot: int, rank: int, *, threads: int,
                   extra_manifest: dict[str, Any]) -> Path:
        """Writes ``rank``'s part of the leased slot's step; its (local or index) path."""

    def present(self, step: int, world: int) -> list[int]:
        """Ranks whose part of ``step`` is complete."""

    def commit(self, step: int, record: dict[str, Any], keep: int,
               timeout: float | None = None) -> None:
        """``COMMIT`` of ``step``, then ``latest``, then prune to ``keep``; ``timeout``:
        the wait for ``latest`` (its lock, its compare-and-swap) ends by then, leaving
        ``latest`` as it is (the step is committed: a restore finds it by listing)."""

    def committed_with(self, step: int, rank: int) -> bool:
        """``step`` is committed with ``rank``'s part."""

    def refresh(self) -> None:
        """After a committed round (the local index of a URL)."""


class PosixRounds:
    """A local (or shared) file-system directory: a rank's part is ``posix.write_slot``'s."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.where = str(self.directory)

    def clear_stale(self, step: int, rank: int) -> None:
        step_dir = self.directory / step_dirname(step)
        d = step_dir / rank_dirname(rank)
        if d.exists() and not (step_dir / COMMIT).exists():
            log.warning("removing %s: left by a round that did not commit", d)
            shutil.rmtree(d, ignore_errors=True)

    def write_rank(self, arena: Arena, slot: int, rank: int, *, threads: int,
                   extra_manifest: dict[str, Any]) -> Path:
        path, _ = posix.write_slot(arena, slot, self.directory, threads=threads,
                                   subdir=rank_dirname(rank), update_latest=False,
                                   extra_manifest=extra_manifest)
        return Path(path)

    def present(self, step: int, world: int) -> list[int]:
        step_dir = self.directory / step_dirname(step)
        return [r for r in range(world) if (step_dir / rank_dirname(r) / MANIFEST).is_file()]

    def commit(self, step: int, record: dict[str, Any], keep: int,
               timeout: float | None = None) -> None:
        step_dir = self.directory / step_dirname(step)
        posix.write_commit(step_dir, record)
        try:
            posix.replace_latest(self.directory, step_dir.name, timeout)
            posix.prune(self.directory, keep)
        except OSError as e:  # committed: `latest` is a hint, the prune runs again next time
            log.warning("step %d is committed in %s, but updating latest/pruning failed: %s",
                        step, self.where, e)

    def committed_with(self, step: int, rank: int) -> bool:
        step_dir = self.directory / step_dirname(step)
        return (step_dir / COMMIT).is_file() and \
            (step_dir / rank_dirname(rank) / MANIFEST).is_file()

    def refresh(self) -> None:
        return None


class RemoteRounds:
    """An object-store URL (``storage.remote_ranks``); ``directory`` is its state
    directory, whose index of committed steps the agreed restore reads."""

    def __init__(self, directory: Path, url: str) -> None:
        from .fsspec import FsspecStorage

        self.directory = Path(directory)
        self.st: FsspecStorage = FsspecStorage(url)
        self.where = self.st.url

    def clear_stale(self, step: int, rank: int) -> None:
        from . import remote_ranks

        with self.st._failing(f"clean-up of rank {rank}'s part of step {step}"):
            remote_ranks.clear_stale(self.st, step, rank)

    def write_rank(self, arena: Arena, slot: int, rank: int, *, threads: int,
                   extra_manifest: dict[str, Any]) -> Path:
        from . import remote_ranks

        remote_ranks.upload_rank(self.st, arena, slot, rank, threads=threads,
                                 extra_manifest=extra_manifest)
        step = int(arena.slot_info(slot)["step"])
        return self.directory / step_dirname(step) / rank_dirname(rank)

    def present(self, step: int, world: int) -> list[int]:
        from . import remote_ranks

        return remote_ranks.present_ranks(self.st, step, world)

    def commit(self, step: int, record: dict[str, Any], keep: int,
               timeout: float | None = None) -> None:
        from . import remote_ranks

        with self.st._failing(f"commit of step {step} to {self.where}"):
            remote_ranks.write_commit(self.st, step, record)
        try:
            self.st.replace_latest(step, timeout)
            self.st.prune(keep)
            remote_ranks.sync_index(self.st)
        except Exception as e:  # noqa: BLE001 - committed: `latest` and the index are hints
            log.warning("step %d is committed at %s, but updating latest/pruning failed: %s",
                        step, self.where, e)

    def committed_with(self, step: int, rank: int) -> bool:
        from . import remote_ranks

        return remote_ranks.committed_with(self.st, step, rank)

    def refresh(self) -> None:
        from . import remote_ranks

        try:
            remote_ranks.sync_index(self.st)
        except Exception as e:  # noqa: BLE001 - the index is rebuilt at the next start
            log.warning("could not refresh the local index of %s: %s", self.where, e)


def round_store(directory: Path) -> PosixRounds | RemoteRounds:
    """The store a round writes to for the rank directory ``directory``."""
    url = url_of_state_dir(directory)
    return PosixRounds(directory) if url is None else RemoteRounds(directory, url)
