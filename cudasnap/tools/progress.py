"""Progress bars for long flushes, restores and verifies (terminal only).

The byte-moving work runs in C++ with the GIL released, so progress is read
from the kernel's per-process I/O counters (``/proc/self/io``: ``wchar`` /
``rchar``, bytes passed to write/read system calls) by a small polling
thread. Off when stderr is not a terminal, when tqdm is missing, or for
operations under ``min_bytes``.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("cudasnap.progress")
MIN_BYTES = 256 << 20


def _io_counter(kind: str) -> int | None:
    key = "wchar" if kind == "write" else "rchar"
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def enabled(total: int, min_bytes: int = MIN_BYTES) -> bool:
    return total >= min_bytes and sys.stderr is not None and sys.stderr.isatty()


@contextlib.contextmanager
def io_progress(total: int, desc: str, kind: str = "write",
                min_bytes: int = MIN_BYTES) -> Iterator[Any]:
    """Shows a byte progress bar while the body moves ``total`` bytes of I/O."""
    start = _io_counter(kind)
    if not enabled(total, min_bytes) or start is None:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    stop = threading.Event()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)

    def poll() -> None:
        done = 0
        while not stop.wait(0.2):
            now = _io_counter(kind)
            if now is None:
                return
            cur = min(total, now - start)
            if cur > done:
                bar.update(cur - done)
                done = cur

    t = threading.Thread(target=poll, name="cudasnap-progress", daemon=True)
    t.start()
    try:
        yield bar
    finally:
        stop.set()
        t.join(timeout=1.0)
        bar.close()
