"""The :class:`Trigger` type: one reason to checkpoint (and possibly exit).

Shared by every trigger source (NVML, injection, signals, watchdog, exception
hooks, peers) and by the policy; it depends on nothing else in cudasnap.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable


class ExitCode(enum.IntEnum):
    """The exit codes of a flush-and-exit (64-113, unused by shells, so a launcher or a
    scheduler can tell why the job stopped and whether to requeue); ``describe`` names it
    (``cudasnap run``'s log)."""

    MANUAL = 0
    EXCEPTION = 1
    GPU_LOST = 75  # the GPU fell off the bus / NVML reports it lost: requeue elsewhere
    GPU_FAULT = 76  # fatal Xid, uncorrected ECC, remap failure, recovery action
    HANG = 77  # the progress watchdog fired
    PREEMPTED = 78  # SIGTERM (preemption, cancel): resume elsewhere
    PEER_FAILURE = 79  # another rank failed; this one flushed and stopped

    @property
    def describe(self) -> str:
        return self.name.lower().replace("_", " ").replace("gpu", "GPU")


class TriggerKind(enum.Enum):
    """Every kind of trigger, with what the other parts derive from it: the exit code a
    flush-and-exit uses when no code is given (the policy), whether the flush must not
    wait for a running copy (the GPU may never finish it: the guard), and whether it
    names a device (fault injection)."""

    XID = ("xid", ExitCode.GPU_FAULT, True, True)
    ECC_DBE = ("ecc_dbe", ExitCode.GPU_FAULT, True, True)
    ECC_UNCORRECTED = ("ecc_uncorrected", ExitCode.GPU_FAULT, True, True)
    REMAP_FAILURE = ("remap_failure", ExitCode.GPU_FAULT, True, True)
    REMAP_PENDING = ("remap_pending", ExitCode.GPU_FAULT, False, True)
    RECOVERY_ACTION = ("recovery_action", ExitCode.GPU_FAULT, True, True)
    GPU_LOST = ("gpu_lost", ExitCode.GPU_LOST, True, True)
    THERMAL = ("thermal", ExitCode.GPU_FAULT, False, True)
    SIGTERM = ("sigterm", ExitCode.PREEMPTED, False, False)
    SIGUSR1 = ("sigusr1", ExitCode.PREEMPTED, False, False)
    HANG = ("hang", ExitCode.HANG, False, False)
    EXCEPTION = ("exception", ExitCode.EXCEPTION, False, False)
    MANUAL = ("manual", ExitCode.MANUAL, False, False)
    PEER_FAILURE = ("peer_failure", ExitCode.PEER_FAILURE, False, False)

    def __init__(self, kind: str, exit_code: ExitCode, no_wait: bool, device: bool) -> None:
        self.kind, self.exit_code, self.no_wait, self.device = kind, exit_code, no_wait, device

    @classmethod
    def of(cls, kind: str) -> TriggerKind:
        return _BY_NAME[kind]


_BY_NAME = {k.kind: k for k in TriggerKind}
TRIGGER_KINDS: frozenset[str] = frozenset(_BY_NAME)

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
