"""Facts about processes of this host, from the kernel (no CUDA, no torch)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def process_start_time(pid: int | None = None) -> float | None:
    """Wall time ``pid`` (default: this process) was started, from /proc (10 ms
    resolution); None where unknown."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
