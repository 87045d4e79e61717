"""The :class:`Trigger` type: one reason to checkpoint (and possibly exit).

Shared by every trigger source (NVML, injection, signals, watchdog, exception
hooks, peers) and by the policy; it depends on nothing else in cudasnap.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

TRIGGER_KINDS: frozenset[str] = frozenset({
    "xid", "ecc_dbe", "ecc_uncorrected", "remap_failure", "remap_pending", "recovery_action",
    "gpu_lost", "thermal", "sigterm", "sigusr1", "hang", "exception", "manual", "peer_failure",
})

#: Xids after which the GPU itself is unusable (reset/reboot needed).
FATAL_XIDS: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
#: Xids caused by the application (illegal address, MMU fault, ...): GPU still fine.
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68})


def classify_xid(code: int) -> str:
    """Return ``"fatal"``, ``"application"`` or ``"other"`` for an Xid code."""
    code = int(code)
    if code in FATAL_XIDS:
        return "fatal"
    if code in APPLICATION_XIDS:
        return "application"
    return "other"


@dataclasses.dataclass(frozen=True)
class Trigger:
    """One reason to checkpoint (and possibly exit)."""

    kind: str
    device: int | None = None
    code: int | None = None
    detail: str = ""
    xid_class: str | None = None
    time: float = dataclasses.field(default_factory=time.time)
    step: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in TRIGGER_KINDS:
            raise ValueError(f"unknown trigger kind {self.kind!r}; expected one of {sorted(TRIGGER_KINDS)}")
        if self.kind == "xid" and self.xid_class is None and self.code is not None:
            object.__setattr__(self, "xid_class", classify_xid(self.code))

    def describe(self) -> str:
        parts = [self.kind]
        if self.code is not None:
            parts.append(f"code={self.code}")
        if self.xid_class:
            parts.append(f"class={self.xid_class}")
        if self.device is not None:
            parts.append(f"gpu={self.device}")
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.detail:
            parts.append(f"({self.detail})")
        return " ".join(parts)


TriggerCallback = Callable[[Trigger], None]
