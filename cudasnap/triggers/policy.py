"""Trigger policy: which :class:`Action` (and exit code) each trigger kind gets.

Every trigger (GPU health event, signal, hang, uncaught exception, manual call)
goes to :meth:`cudasnap.triggers.dispatch.Dispatcher.handle`, which asks the
:class:`Policy` what to do and then logs, flushes the snapshot, or flushes and
exits the process.

Exit codes used by FLUSH_AND_EXIT (chosen to sit in the unused 64-113 range so a
launcher/scheduler can tell *why* the job stopped and whether to requeue):

* ``EXIT_GPU_LOST = 75``      GPU fell off the bus / NVML reports it lost: requeue on another node.
* ``EXIT_GPU_FAULT = 76``     fatal Xid, double-bit/uncorrected ECC, remap failure, recovery action.
* ``EXIT_HANG = 77``          progress watchdog fired (no step boundary for ``timeout_s``).
* ``EXIT_PREEMPTED = 78``     SIGTERM (scheduler preemption / job cancel): resume elsewhere.
* ``EXIT_PEER_FAILURE = 79``  another rank failed; this rank flushed and stopped.
* ``EXIT_EXCEPTION = 1``      only if a policy maps ``exception`` to flush_exit.

Environment: ``CUDASNAP_POLICY`` overrides the defaults, e.g.
``"thermal=flush,sigusr1=flush_exit,xid.other=flush,hang=flush_exit:90"``.
Keys are trigger kinds or ``xid.fatal`` / ``xid.application`` / ``xid.other``
(``xid`` sets all three); actions are ``ignore``, ``log``, ``flush``,
``flush_exit`` (optionally ``:CODE``).
"""

from __future__ import annotations

import enum
import logging

from ..config import Settings
from ..errors import ConfigError
from .kinds import TRIGGER_KINDS, ExitCode, Trigger, TriggerKind

logger = logging.getLogger("cudasnap.triggers")

EXIT_GPU_LOST = ExitCode.GPU_LOST  # the names the policy's users know (one home: kinds.py)
EXIT_GPU_FAULT = ExitCode.GPU_FAULT
EXIT_HANG = ExitCode.HANG
EXIT_PREEMPTED = ExitCode.PREEMPTED
EXIT_PEER_FAILURE = ExitCode.PEER_FAILURE
EXIT_EXCEPTION = ExitCode.EXCEPTION
EXIT_MANUAL = ExitCode.MANUAL

ENV_POLICY = "CUDASNAP_POLICY"


class Action(enum.Enum):
    IGNORE = "ignore"
    LOG = "log"
    FLUSH = "flush"
    FLUSH_AND_EXIT = "flush_exit"


_ACTION_NAMES = {"ignore": Action.IGNORE, "log": Action.LOG, "flush": Action.FLUSH,
                 "flush_exit": Action.FLUSH_AND_EXIT, "flush_and_exit": Action.FLUSH_AND_EXIT}

#: Exit code used when a kind is (re)mapped to FLUSH_AND_EXIT without an explicit code.
DEFAULT_EXIT_CODES: dict[str, int] = {k.kind: int(k.exit_code) for k in TriggerKind}

Rule = tuple[Action, "int | None"]
_XID_KEYS = ("xid.fatal", "xid.application", "xid.other")
POLICY_KEYS: frozenset[str] = frozenset((TRIGGER_KINDS - {"xid"}) | set(_XID_KEYS))


def _default_rules() -> dict[str, Rule]:
    fx = Action.FLUSH_AND_EXIT
    return {
        "xid.fatal": (fx, EXIT_GPU_FAULT), "xid.application": (Action.FLUSH, None), "xid.other": (Action.LOG, None),
        "ecc_dbe": (fx, EXIT_GPU_FAULT), "ecc_uncorrected": (fx, EXIT_GPU_FAULT),
        "remap_failure": (fx, EXIT_GPU_FAULT), "recovery_action": (fx, EXIT_GPU_FAULT),
        "remap_pending": (Action.FLUSH, None), "gpu_lost": (fx, EXIT_GPU_LOST), "thermal": (Action.LOG, None),
        "sigterm": (fx, EXIT_PREEMPTED), "sigusr1": (Action.FLUSH, None), "hang": (fx, EXIT_HANG),
        "exception": (Action.FLUSH, None), "manual": (Action.FLUSH, None), "peer_failure": (fx, EXIT_PEER_FAILURE),
    }


class Policy:
    """Maps a trigger to an :class:`Action` and (for FLUSH_AND_EXIT) an exit code."""

    def __init__(self, rules: dict[str, Rule] | None = None) -> None:
        self.rules: dict[str, Rule] = _default_rules()
        for key, rule in (rules or {}).items():
            self.set(key, *rule)

    def set(self, key: str, action: Action, code: int | None = None) -> None:
        keys = _XID_KEYS if key == "xid" else (key,)
        for k in keys:
            if k not in POLICY_KEYS:
                raise ValueError(f"unknown policy key {key!r}; expected one of {sorted(POLICY_KEYS | {'xid'})}")
            base = k.split(".")[0]
            exit_code = (code if code is not None else DEFAULT_EXIT_CODES[base]) \
                if action is Action.FLUSH_AND_EXIT else None
            self.rules[k] = (action, exit_code)

    @classmethod
    def parse(cls, spec: str, base: "Policy | None" = None) -> "Policy":
        """Parse ``"key=action[:code],..."`` on top of ``base`` (default policy)."""
        policy = cls(dict(base.rules)) if base is not None else cls()
        for raw in spec.replace(";", ",").split(","):
            entry = raw.strip()
            if not entry:
                continue
            key, sep, value = (s.strip().lower() for s in entry.partition("="))
            act_name, _, code_s = value.partition(":")
            action = _ACTION_NAMES.get(act_name.strip())
            if not sep or action is None:
                raise ConfigError(f"bad {ENV_POLICY} entry {entry!r}: expected KEY=ignore|log|flush|flush_exit[:CODE]")
            code: int | None = None
            if code_s:
                if action is not Action.FLUSH_AND_EXIT or not code_s.strip().isdigit():
                    raise ConfigError(f"bad {ENV_POLICY} entry {entry!r}: ':CODE' must be an integer "
                                     "and only goes with flush_exit")
                code = int(code_s)
            try:
                policy.set(key, action, code)
            except ValueError as exc:
                raise ConfigError(f"bad {ENV_POLICY} entry {entry!r}: {exc}") from None
        return policy

    @classmethod
    def from_settings(cls, settings: Settings) -> "Policy":
        """The default policy with ``CUDASNAP_POLICY``'s overrides (``settings``: the
        environment, read by the caller's entry point)."""
        return cls.parse(settings.policy or "")

    def decide(self, trigger: Trigger) -> tuple[Action, int | None]:
        key = trigger.kind
        if key == "xid":
            key = "xid." + (trigger.xid_class or "other")
        rule = self.rules.get(key)
        if rule is None:
            logger.warning("no policy for trigger kind %r; logging only", key)
            return Action.LOG, None
        return rule

    def describe(self) -> str:
        return ", ".join(f"{k}={a.value}" + (f":{c}" if c is not None else "")
                         for k, (a, c) in sorted(self.rules.items()))
