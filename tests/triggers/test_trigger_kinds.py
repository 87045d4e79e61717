"""One home for a trigger kind (issue 47): ``TriggerKind`` carries its default exit code,
whether a flush after it may wait for a running copy, and whether it names a device; the
policy, the guard, fault injection and ``cudasnap run``'s exit log derive from it."""
from __future__ import annotations

import pytest
from helpers import parts

from cudasnap.errors import ConfigError
from cudasnap.supervisor.child import EXIT_CODES, describe_exit
from cudasnap.triggers import inject, policy
from cudasnap.triggers.kinds import TRIGGER_KINDS, ExitCode, Trigger, TriggerKind


def test_every_part_reads_the_kinds_from_the_enum() -> None:
    assert TRIGGER_KINDS == {k.kind for k in TriggerKind}
    assert policy.DEFAULT_EXIT_CODES == {k.kind: int(k.exit_code) for k in TriggerKind}
    assert parts.no_wait_kinds() == {"xid", "ecc_dbe", "ecc_uncorrected", "gpu_lost", "remap_failure",
                              "recovery_action"}
    assert EXIT_CODES[77] == "hang" and describe_exit(75) == "exit code 75 (GPU lost)"
    assert policy.EXIT_PEER_FAILURE == 79 == ExitCode.PEER_FAILURE


def test_a_device_kind_gets_device_0_in_an_injection_and_the_others_none() -> None:
    for k in TriggerKind:
        code = "=79" if k is TriggerKind.XID else ""  # an Xid needs its code
        (fault,) = inject.parse_inject(f"{k.kind}{code}@step=3")
        assert fault.device == (0 if k.device else None), k
    with pytest.raises(ValueError, match="unknown trigger kind"):
        Trigger("nvlink")
    with pytest.raises(ConfigError, match="unknown kind"):
        inject.parse_inject("nvlink@step=3")
