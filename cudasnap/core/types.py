"""Types the components share (issue 36): the protocols of duck-typed parameters.

Type-only: nothing here is imported at run time but ``typing`` (no torch, no engine).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from cudasnap._C import FileReadAhead


class SnapshotFile(Protocol):
    """A snapshot's data file opened and checked but not read: the byte source a storage
    hands a restore (``storage.open_data`` for a local snapshot: ``storage.data_file.DataFile``).
    A record, no copy logic: ``core.file_copy`` reads it, each chunk checked against
    ``crcs`` before any byte of it is copied."""

    fd: int
    path: Path
    nbytes: int
    chunk_bytes: int
    crcs: list[int]
    threads: int
    io_bytes: int
    direct: bool
    ahead: FileReadAhead | None

    def stop_ahead(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...


class Stateful(Protocol):
    """An ``extra`` object with ``state_dict()``/``load_state_dict()`` (DCP's ``Stateful``)."""

    def state_dict(self) -> object: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> object: ...
