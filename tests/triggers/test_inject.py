"""Tests for cudasnap.triggers.inject / monitor: scripted faults, also through the signal path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.triggers import Collector, clean_trigger_env  # noqa: F401 (autouse fixture)

from cudasnap.config import Settings
from cudasnap.triggers.inject import InjectedFault, InjectedSource, parse_inject
from cudasnap.triggers.kinds import Trigger
from cudasnap.triggers.monitor import HealthMonitor

REPO = Path(__file__).resolve().parents[2]


def test_injected_kinds_fire_at_their_step_and_not_before() -> None:
    got = Collector()
    spec = ("xid=79@step=2, ecc_dbe@step=3; gpu_lost@step=4,thermal@step=5,remap_failure@step=6,"
            "ecc_uncorrected=3@step=7,xid=13@step=8@dev=2,hang@step=9")
    src = InjectedSource(spec, got)
    src.start()
    try:
        expected = {2: ("xid", 79, "fatal", 0), 3: ("ecc_dbe", None, None, 0), 4: ("gpu_lost", None, None, 0),
                    5: ("thermal", None, None, 0), 6: ("remap_failure", None, None, 0),
                    7: ("ecc_uncorrected", 3, None, 0), 8: ("xid", 13, "application", 2)}
        n = 0
        for step in range(12):
            src.notify_step(step)
            if step in expected:
                n += 1
                t = got.wait_for(n)[-1]
                assert (t.kind, t.code, t.xid_class, t.device) == expected[step]
                assert t.step == step and t.detail.startswith("injected")
            time.sleep(0.005)
            assert len(got.items) == n, f"unexpected trigger after step {step}: {got.items}"
            assert src.should_hang(step) is (step >= 9)
        assert n == 7
    finally:
        src.stop()


def test_injected_skipped_steps_and_time_based() -> None:
    got = Collector()
    src = InjectedSource("ecc_dbe@step=3,thermal@step=5,recovery_action=4@t=0.05", got)
    t0 = time.monotonic()
    src.start()
    try:
        src.notify_step(10)                               # jumped past both step faults
        trig = got.wait_for(3)
        assert time.monotonic() - t0 >= 0.05
        assert sorted(t.kind for t in trig) == ["ecc_dbe", "recovery_action", "thermal"]
        timed = next(t for t in trig if t.kind == "recovery_action")
        assert timed.code == 4 and timed.step == 10
    finally:
        src.stop()


def test_injected_exception_and_monitor_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDASNAP_INJECT", "exception@step=2,hang@t=0")
    mon = HealthMonitor(lambda t: None, inject=Settings.from_env().inject)
    assert mon.injected and mon.available and "exception@step=2" in mon.describe()
    mon.start()
    mon.notify_step(1)
    with pytest.raises(InjectedFault, match="step 2"):
        mon.notify_step(2)
    mon.notify_step(3)                                    # fires once only
    assert mon.should_hang(0)
    mon.stop()


@pytest.mark.parametrize("spec,bad", [
    ("xid@step=3", "xid@step=3"), ("bogus@step=1", "bogus@step=1"), ("ecc_dbe", "ecc_dbe"),
    ("ecc_dbe@stp=1", "ecc_dbe@stp=1"), ("xid=79@step=x", "xid=79@step=x"), ("thermal@t=-1", "thermal@t=-1"),
    ("ecc_dbe@step=1,gpu_lost@step=2@t=3", "gpu_lost@step=2@t=3"), (" , ", ""),
])
def test_bad_inject_spec(spec: str, bad: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse_inject(spec)
    assert bad in str(ei.value)


def test_injected_sigusr1_runs_real_handler_path() -> None:
    from cudasnap.triggers import Dispatcher, install_signal_handlers
    flushed: list[Trigger] = []
    exits: list[int] = []
    d = Dispatcher(lambda t: flushed.append(t) or "/snap/1", exit_fn=exits.append, step_fn=lambda: 4)
    handlers = install_signal_handlers(d.handle, signals=(signal.SIGUSR1,))
    try:
        src = InjectedSource("sigusr1@step=4")
        src.notify_step(3)
        assert not flushed
        src.notify_step(4)
        deadline = time.monotonic() + 2
        while not flushed and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        handlers.uninstall()
    assert [(t.kind, t.step) for t in flushed] == [("sigusr1", 4)] and exits == []


CHILD = textwrap.dedent("""
    import logging, os, sys, time
    logging.basicConfig(level=logging.INFO)
    from cudasnap.triggers.monitor import HealthMonitor
    from cudasnap.triggers import Dispatcher, install_signal_handlers
    out = sys.argv[1]
    def flush(trig):
        with open(out + ".tmp", "w") as f:
            f.write("begin\\n"); f.flush(); time.sleep(0.3)
            f.write("complete %s\\n" % trig.kind)
        os.replace(out + ".tmp", out)
        return out
    step = [0]
    d = Dispatcher(flush, step_fn=lambda: step[0])
    install_signal_handlers(d.handle)
    mon = HealthMonitor(d.handle, inject="sigterm@step=10")
    mon.start()
    for step[0] in range(300):
        mon.notify_step(step[0])
        time.sleep(0.002)
    sys.exit(3)
""")


@pytest.mark.slow
def test_injected_sigterm_child_flushes_then_exits_78(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / "snap.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDASNAP_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True,
                          text=True, timeout=20)
    assert proc.returncode == 78, proc.stderr
    assert out.read_text() == "begin\ncomplete sigterm\n"
    assert "step=10" in proc.stderr and "exiting with code 78" in proc.stderr
