"""Bytes of snapshot data moved by Python code (the object-store storage), per process.

The POSIX storage moves its data in C++: the flusher counts those bytes itself
(``_C.io_bytes()``). The fsspec storage moves its data objects in Python
(uploads and downloads through the filesystem object), so it counts them here,
per block as it goes. ``cudasnap.storage.progress.bytes_written()`` /
``bytes_read()`` add both, so a progress bar advances for ``s3://`` flushes and
restores too. Only data objects count (``data.bin``), as on disk: not the
manifest, COMMIT or ``latest``. Monotonic, thread-safe; a leaf module.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_written = 0
_read = 0


def add_written(nbytes: int) -> None:
    """Counts ``nbytes`` of snapshot data handed to an object store."""
    global _written
    if nbytes > 0:
        with _lock:
            _written += int(nbytes)


def add_read(nbytes: int) -> None:
    """Counts ``nbytes`` of snapshot data received from an object store."""
    global _read
    if nbytes > 0:
        with _lock:
            _read += int(nbytes)


def io_bytes() -> tuple[int, int]:
    """(written, read): data bytes the Python storage moved in this process so far."""
    with _lock:
        return _written, _read


__all__ = ["add_written", "add_read", "io_bytes"]
