"""Peer liveness without pid lookups (issue 35 item 4): a rank's presence port lives exactly as
long as its process, on this node or another, in any pid namespace.

Unit tests of the probe and of when a refusal counts, processes that freeze, fork or die;
then a 2-rank torchrun job in a pid namespace of its own without its own /proc (pids there
start at 90001, which the host's /proc does not have: the old liveness by pid lookup took
every healthy peer for dead, exit 79): it runs to the end, and a rank SIGKILLed there is
noticed by its port within seconds and the job resumes.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudasnap.distributed.kv import KV
from cudasnap.distributed.liveness import REFUSED, UNKNOWN, UP, Liveness, probe
from tests.distributed.test_end_of_job import _Store
from tools.dist import launch

HB_S = 0.02


def _closed_port() -> str:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def _liveness(store: _Store, peer_host: str, port: str, addr: str = "127.0.0.2") -> Liveness:
    """Rank 0 of 2 (its presence port on ``addr``), rank 1 on ``peer_host`` at ``port``."""
    kv = KV("t/", store=store, monitor_store=store)  # type: ignore[arg-type]
    live = Liveness(kv, 0, 2, 10.0, lambda: [1], lambda: 1, heartbeat_s=HB_S, addr=addr)
    store.set("t/host/1", peer_host)
    store.set("t/proc/1", port)
    store.set("t/hb/1", "1:1:1")
    return live


def _checks(live: Liveness, n: int = 6) -> list[int]:
    found = []
    for _ in range(n):
        found += live.check()
        time.sleep(5 * HB_S)  # its heartbeat lags, and a verification may be tried again
    return found


def test_probe_tells_a_listening_port_from_a_closed_one() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    up = f"127.0.0.1:{srv.getsockname()[1]}"
    got = probe({0: up, 1: _closed_port(), 2: "not-an-address:x"}, 0.5)
    srv.close()
    assert got == {0: UP, 1: REFUSED, 2: UNKNOWN}


def test_a_refusal_from_another_host_counts_only_once_its_port_answered() -> None:
    # Never answered: maybe a firewall rejecting connections; the silence decides.
    live = _liveness(_Store(), "another-host", _closed_port())
    assert _checks(live) == [] and live.dead == set()

    # Answered once, then its process is gone: dead at once.
    srv = socket.create_server(("127.0.0.1", 0))
    store = _Store()
    live = _liveness(store, "another-host", f"127.0.0.1:{srv.getsockname()[1]}")
    assert live.check() == []  # verified: the port answered
    srv.close()
    assert _checks(live) == [1] and live.dead == {1}

    # On this host a refusal is the process gone, verified or not.
    live = _liveness(_Store(), socket.gethostname(), _closed_port())
    assert _checks(live) == [1]


def test_a_refusal_at_this_ranks_own_loopback_address_is_not_another_nodes() -> None:
    # Every node fell back to 127.0.0.1 (no route to MASTER_ADDR): a probe of another
    # node's "127.0.0.1:port" reaches this node. Even once such a port answered here, its
    # refusal says nothing of the peer: the silence decides.
    srv = socket.create_server(("127.0.0.1", 0))
    live = _liveness(_Store(), "another-host", f"127.0.0.1:{srv.getsockname()[1]}",
                     addr="127.0.0.1")
    assert live.check() == []
    srv.close()
    assert _checks(live) == [] and live.dead == set()


def test_a_peer_whose_heartbeat_moves_is_not_probed() -> None:
    store = _Store()
    live = _liveness(store, socket.gethostname(), _closed_port())
    live.VERIFY_TRIES = 0  # the one-time reachability probe off: only lag probes
    for i in range(6):
        store.set("t/hb/1", f"{i + 2}:1:1")
        assert live.check() == []
        time.sleep(HB_S / 2)


_HOLDER = r"""
import os, signal, sys, time
from cudasnap.distributed.liveness import Presence
p = Presence("127.0.0.1")
if sys.argv[1] == "fork":
    if os.fork() == 0:  # a DataLoader worker's kind of child: lives on after its parent
        time.sleep(60)
        os._exit(0)
print(p.addr, flush=True)
if sys.argv[1] == "fork":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _holder(mode: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, mode], stdout=subprocess.PIPE,
                         text=True, start_new_session=True,
                         env=dict(os.environ, PYTHONPATH=str(launch.REPO)))
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def test_a_frozen_process_answers_and_a_killed_one_with_a_forked_child_refuses() -> None:
    p, addr = _holder("plain")
    try:
        assert probe({0: addr}, 2.0) == {0: UP}
        p.send_signal(signal.SIGSTOP)  # frozen: the kernel still accepts for it
        assert probe({0: addr}, 2.0) == {0: UP}
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert probe({0: addr}, 2.0) == {0: REFUSED}

    p, addr = _holder("fork")
    try:
        p.wait(timeout=30)  # the holder killed itself; its forked child sleeps on
        deadline = time.monotonic() + 10
        while probe({0: addr}, 0.5)[0] != REFUSED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe({0: addr}, 0.5) == {0: REFUSED}, "the child kept the presence port open"
    finally:
        os.killpg(p.pid, signal.SIGKILL)


# ------------------------------------------------------------ a pid namespace, host /proc
def _pid_namespace() -> list[str] | None:
    """A command prefix running torchrun in a new pid namespace (host /proc kept) whose
    pids start at 90001; None where this machine cannot make one."""
    if shutil.which("unshare") is None:
        return None
    probe_cmd = ["unshare", "-r", "-p", "-f", "sh", "-c",
                 "echo 90000 > /proc/sys/kernel/ns_last_pid && sh -c 'echo $$'"]
    try:
        out = subprocess.run(probe_cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or out.stdout.strip() != "90001" or Path("/proc/90001").exists():
        return None
    return ["unshare", "-r", "-p", "-f", "sh", "-c",
            'echo 90000 > /proc/sys/kernel/ns_last_pid && exec "$@"', "torchrun"]


def _errors(r: launch.Run) -> str:
    """The lines of the ranks' tracebacks and errors, then the log's tail."""
    keep = [ln for ln in r.log.splitlines() if ln.startswith("[rank") or "ERROR" in ln
            or "Error" in ln]
    return f"rc={r.rc} after {r.seconds:.0f} s\n" + "\n".join(keep[-80:]) + "\n----\n" + \
        launch.log_tail(r, 30)


@pytest.mark.slow
def test_ranks_in_a_pid_namespace_without_its_own_proc(tmp_path: Path) -> None:
    prefix = _pid_namespace()
    if prefix is None:
        pytest.skip("this machine cannot make a user + pid namespace (unshare -r -p -f) "
                    "with ns_last_pid writable")
    steps = 16
    env = {"STEPS": str(steps), "CUDASNAP_PEER_TIMEOUT_S": "30"}
    ok = launch.run(tmp_path / "ok", nproc=2, max_restarts=0, env=env, prefix=prefix)
    launch.cleanup_arenas(ok.job)
    assert ok.rc == 0 and len(ok.ranks) == 2, _errors(ok)
    assert "is gone" not in ok.log and "silent for" not in ok.log, launch.log_tail(ok)
    assert all(int(info["pid"]) > 90000 for info in ok.ranks.values()), ok.ranks

    killed = launch.run(tmp_path / "kill", nproc=2, max_restarts=1, prefix=prefix,
                        env=dict(env, KILL_RANK="1", KILL_STEP="8"))
    launch.cleanup_arenas(killed.job)
    assert killed.rc == 0 and len(killed.ranks) == 2, _errors(killed)
    # Noticed by its port (the 30 s silence would be too late for torchrun's restart).
    assert "peer rank 1 is gone (its presence port refused a connection)" in killed.log, \
        launch.log_tail(killed)
    for info in killed.ranks.values():
        assert info["attempt"] == 1 and info["start"] >= 7, info
