"""Exception hierarchy of cudasnap.

Every error raised by cudasnap, from Python or from the C++ engine, is a
:class:`SnapshotError`. The C++ side raises with the source file, line and the
failing call or check in the message.
"""
from __future__ import annotations


class SnapshotError(RuntimeError):
    """Base class of all cudasnap errors."""


class CorruptSnapshot(SnapshotError):
    """A snapshot (file, manifest or shared-memory slot) failed a checksum or is torn."""


class IncompatibleSnapshot(SnapshotError):
    """A snapshot does not fit the live model/optimizer (names, shapes, dtypes, version)."""


class StagingError(SnapshotError):
    """The shared-memory staging arena could not be created, opened or used."""


class FlushError(SnapshotError):
    """Writing a snapshot to durable storage failed (disk full, permissions, I/O)."""


class CudaError(SnapshotError):
    """A CUDA runtime call made by cudasnap failed."""


class ConfigError(SnapshotError, ValueError):
    """Bad arguments or environment configuration."""


__all__ = [
    "SnapshotError", "CorruptSnapshot", "IncompatibleSnapshot", "StagingError",
    "FlushError", "CudaError", "ConfigError",
]


def exception_active() -> BaseException | None:
    """The exception this thread is handling or propagating (``close()`` called from an
    ``except``/``finally`` block or ``__exit__``), or None; a clean ``SystemExit`` (code 0
    or None: ``sys.exit()`` at a normal end) is not a failure."""
    import sys

    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return None
    return exc
