"""Progress bars for long flushes, restores and verifies (terminal only).

On local disk the byte-moving work runs in C++ with the GIL released; its
flusher counts the bytes it writes and reads back in atomic counters
(``_C.io_bytes()``). The object-store storage (``s3://``, fsspec) moves its
data objects in Python and counts them in ``cudasnap.storage.counters``
(beside this module).
``bytes_written``/``bytes_read`` are the sum of both, and a small thread polls
them into a tqdm bar. Unlike the kernel's per-process counters
(``/proc/self/io``) these count only snapshot data, not every thread's I/O.
Off when stderr is not a terminal, when tqdm is missing, or for operations
under ``min_bytes``.

    with io_progress(nbytes, "cudasnap flush step 7", bytes_written): ...
    with io_progress(nbytes, "cudasnap restore step-7", bytes_read): ...
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

log = logging.getLogger("cudasnap.progress")
MIN_BYTES = 256 << 20
POLL_S = 0.2

Counter = Callable[[], int]
# "write" / "read": the flusher's counters (bytes_written / bytes_read).
CounterArg = Counter | Literal["write", "read"]


def bytes_written() -> int:
    """Snapshot data bytes written in this process (monotonic): by the native flusher
    to files, plus by the object-store storage to objects."""
    from .._native import native
    from . import counters

    return int(native().io_bytes()[0]) + counters.io_bytes()[0]


def bytes_read() -> int:
    """Snapshot data bytes read back in this process (monotonic): by the native flusher
    from files, plus by the object-store storage from objects."""
    from .._native import native
    from . import counters

    return int(native().io_bytes()[1]) + counters.io_bytes()[1]


def _counter(counter: CounterArg) -> Counter:
    if callable(counter):
        return counter
    if counter == "write":
        return bytes_written
    if counter == "read":
        return bytes_read
    raise ValueError(f"io_progress: counter must be a callable, 'write' or 'read', not {counter!r}")


def enabled(total: int, min_bytes: int = MIN_BYTES) -> bool:
    return total >= min_bytes and sys.stderr is not None and sys.stderr.isatty()


@contextlib.contextmanager
def io_progress(total: int, desc: str, counter: CounterArg = bytes_written,
                min_bytes: int = MIN_BYTES) -> Iterator[Any]:
    """Shows a byte progress bar while the body moves ``total`` bytes.

    ``counter`` returns a monotonic byte count (e.g. ``bytes_written``); the bar
    shows how far it moved since entry, capped at ``total``.
    """
    read = _counter(counter)
    if not enabled(total, min_bytes):
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    start = read()
    stop = threading.Event()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)
    done = 0
    lock = threading.Lock()

    def advance() -> None:
        nonlocal done
        with lock:
            cur = min(total, max(0, read() - start))
            if cur > done:
                bar.update(cur - done)
                done = cur

    def poll() -> None:
        while not stop.wait(POLL_S):
            advance()

    t = threading.Thread(target=poll, name="cudasnap-progress", daemon=True)
    t.start()
    try:
        yield bar
    finally:
        stop.set()
        t.join(timeout=1.0)
        advance()  # the bar ends where the counter ended
        bar.close()
