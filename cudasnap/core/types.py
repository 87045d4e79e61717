"""Types the components share (issue 36): the protocols of duck-typed parameters.

Type-only: nothing here is imported at run time but ``typing`` (no torch, no engine).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from cudasnap._C import RestorePlan


class SnapshotFile(Protocol):
    """A snapshot's data file opened and checked but not read (what
    ``storage.open_data`` returns for a local snapshot: ``storage.posix.DataFile``)."""

    nbytes: int

    def read(self) -> torch.Tensor: ...

    def scatter(self, plan: RestorePlan, extra: list[tuple[int, int, int]]) -> object: ...

    def scatter_device(self, device_spans: list[tuple[int, int, int]],
                       host_spans: list[tuple[int, int, int]], device: int) -> object: ...

    def close(self) -> None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...


class Stateful(Protocol):
    """An ``extra`` object with ``state_dict()``/``load_state_dict()`` (DCP's ``Stateful``)."""

    def state_dict(self) -> object: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> object: ...
