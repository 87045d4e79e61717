"""A slot leased by another process (the supervisor's orphan flush) is never overwritten.

Leases used to be per process: a restarted child that adopted the arena could
overwrite the slot its supervisor was still flushing. Leases are now also OFD
byte-range read locks on the arena file, which other processes see and which die
with the process that holds them.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_staging import fill_slot, make

from cudasnap.errors import StagingError


@pytest.fixture
def C(native_C):
    return native_C


def _leaser(path: str, slot: int) -> subprocess.Popen[str]:
    """Another process: opens the arena read-only, leases ``slot``, says so, waits for stdin."""
    code = textwrap.dedent(f"""
        import sys, torch
        from cudasnap._native import native
        a = native().Arena.open({path!r}, False)
        a.lease({slot})
        print("leased", flush=True)
        sys.stdin.readline()
        a.release({slot})
        print("released", flush=True)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line == "leased", f"leaser process failed: {line!r}"
    return p


def test_slot_leased_by_another_process_is_not_picked_nor_written(C, snap_env):
    a = make(C, snap_env, slots=2)
    rng = np.random.default_rng(0)
    fill_slot(C, a, 0, 1, 5000, rng)
    fill_slot(C, a, 1, 2, 5000, rng)  # newest: slot 1; slot 0 is the one to overwrite next
    assert a.pick_write_slot() == 0
    p = _leaser(str(snap_env.scratch_arena("a")), 0)
    try:
        assert a.leases(0) == 0  # not leased by this process ...
        assert a.pick_write_slot() == -1  # ... but by the other one
        with pytest.raises(StagingError, match="leased"):
            a.begin_write(0, 3, b'{"step":3}')
        assert a.slot_info(0)["valid"] and a.slot_info(0)["step"] == 1
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "released"
        assert a.pick_write_slot() == 0
    finally:
        p.kill()
        p.wait(30)


def test_lease_of_a_killed_process_does_not_pin_the_slot(C, snap_env):
    a = make(C, snap_env, slots=2)
    rng = np.random.default_rng(1)
    fill_slot(C, a, 0, 1, 100, rng)
    fill_slot(C, a, 1, 2, 100, rng)
    p = _leaser(str(snap_env.scratch_arena("a")), 0)
    assert a.pick_write_slot() == -1
    p.kill()  # SIGKILL while holding the lease: the lock dies with the process
    p.wait(30)
    assert a.pick_write_slot() == 0
    fill_slot(C, a, 0, 3, 100, rng)
    assert a.slot_info(0)["step"] == 3


def test_own_leases_still_count_and_release_unlocks(C, snap_env):
    a = make(C, snap_env, slots=2)
    rng = np.random.default_rng(2)
    fill_slot(C, a, 0, 1, 100, rng)
    fill_slot(C, a, 1, 2, 100, rng)
    a.lease(0)
    a.lease(0)
    assert a.pick_write_slot() == -1
    a.release(0)
    assert a.pick_write_slot() == -1  # one lease left
    a.release(0)
    assert a.pick_write_slot() == 0
