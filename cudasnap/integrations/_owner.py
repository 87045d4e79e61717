"""What the framework callbacks share: owning one Snapshotter and its last stats, and the
defaults they take from the environment (through cudasnap.config.Settings)."""
from __future__ import annotations

from typing import Any

from ..config import Settings


def default_health(health: bool | None) -> bool:
    """The callbacks' guard: on unless ``health=False`` or ``CUDASNAP_HEALTH`` is false."""
    if health is not None:
        return bool(health)
    return Settings.from_env().health is not False


def env_directory() -> str | None:
    """``CUDASNAP_DIR`` (set by ``cudasnap run``), or None."""
    return Settings.from_env().directory


class SnapshotterOwner:
    """Mixin: ``self.snapshotter`` (or None) and ``self.last_stats`` after it closed."""

    snapshotter: Any = None
    last_stats: dict[str, Any] | None = None

    def _close(self, keep_arena: bool | None = None) -> None:
        snap, self.snapshotter = self.snapshotter, None
        if snap is not None:
            self.last_stats = snap.stats()
            snap.close(keep_arena=keep_arena)

    def _end_training(self, flush: bool) -> None:
        """Training ended normally: flush the final snapshot when asked, then close."""
        snap = self.snapshotter
        if snap is None:
            return
        try:
            if flush:
                snap.flush(wait=True, timeout=60.0)
        finally:
            self._close()

    def stats(self) -> dict[str, Any] | None:
        """The live Snapshotter's stats(), or the last ones after training ended."""
        return self.snapshotter.stats() if self.snapshotter is not None else self.last_stats
