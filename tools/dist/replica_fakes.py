"""Injected parts for Replicators run in one process (tests/distributed/test_node_loss.py,
test_parity.py): the store as a dict, a rank's local snapshots as one arena, a bounded wait."""
from __future__ import annotations

import time
from pathlib import Path


class KV:
    """The KV's get/set/compare_set/delete on a dict."""

    prefix = "test/"

    def __init__(self) -> None:
        self.d: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self.d.get(key)

    def set(self, key: str, value: str) -> None:
        self.d[key] = value

    def propose(self, key: str, value: str) -> str:
        return self.d.setdefault(key, value)

    def delete(self, key: str) -> None:
        self.d.pop(key, None)


class Local:
    """LocalSnapshots of one rank: ``arena`` (or none), training at step 5."""

    def __init__(self, rank: int, shm: Path, arena=None, world_size: int = 2) -> None:
        self.rank, self.world_size, self.job, self.flush_threads = rank, world_size, "job", 2
        self.shm, self._arena = shm, arena

    def arenas(self):
        return [self._arena] if self._arena is not None else []

    def last_step(self):
        return 5

    def arena_path_of(self, rank: int) -> Path:
        return self.shm / f"cudasnap-job-r{rank}.arena"


def wait(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)
