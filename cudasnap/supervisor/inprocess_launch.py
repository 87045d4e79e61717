"""``cudasnap run --inprocess``: the launcher of a job that restarts in place.

    cudasnap run --inprocess --nproc 4 --spares 1 --dir ckpt -- python train.py

It hosts the control store (a ``TCPStore`` of this process: not a rank, so no rank's death
takes it), starts one process per rank and the warm spares (``CUDASNAP_CONTROL``,
``CUDASNAP_UID``, ``CUDASNAP_WORLD``, ``CUDASNAP_NPROC``, ``LOCAL_RANK``, ``CUDASNAP_DIR``,
``CUDASNAP_JOB``), and waits. A rank that dies is the in-process restart's to handle
(cudasnap.distributed.inprocess: a spare takes its rank, the survivors keep their process);
the launcher beats for each live process (``lhb/<uid>``: a training thread that holds the
GIL for long, as a gloo group connecting to a slow peer does, keeps the process's own
heartbeat from running) and says at once when one ended (``gone/<uid>``). When that restart
cannot go on (no spare left: the store's ``failed`` key, or the job's processes all ended
without its ``done``), it stops what still runs and **falls back to a full restart**,
logged with the reason: every process started again with a new control store, restoring
from the arenas left in shared memory, up to ``--max-restarts`` times.

Several nodes: one launcher per node, each given the job's store (``--control HOST:PORT``,
hosted by a launcher started with ``--host-control`` on a machine that is not lost with a
node) and the uids it runs (``--uids A-B``: ranks are uids ``0..world-1``, spares the rest);
a full restart is then the scheduler's (the launcher exits non-zero).

Call order: :func:`launch` -> per attempt ``_start`` (each process) -> ``_wait`` (polls the
processes and the store) -> the verdict (done, failed and restart, or give up).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._proc import parent_death_signal
from ..errors import ConfigError

log = logging.getLogger("cudasnap.run")

_POLL_S = 0.05
_GRACE_S = 5.0  # a failed job's processes still running get this long before SIGKILL


@dataclass(frozen=True)
class Layout:
    """Who this launcher starts: the job's ``world`` ranks and ``nproc`` processes in all
    (ranks and spares), and this launcher's uids ``first..last``."""

    world: int
    nproc: int
    first: int
    last: int

    @staticmethod
    def parse(ranks: int, spares: int, uids: str | None) -> Layout:
        """From ``--nproc`` (the job's ranks), ``--spares`` and ``--uids``."""
        if ranks < 1 or spares < 0:
            raise ConfigError(f"--nproc must be 1 or more and --spares 0 or more, not "
                              f"{ranks} and {spares}")
        w = ranks
        total = w + spares
        first, last = 0, total - 1
        if uids:
            a, _, b = uids.partition("-")
            if not a.isdigit() or (b and not b.isdigit()):
                raise ConfigError(f"--uids takes A-B (this launcher's process ids), not {uids!r}")
            first, last = int(a), int(b or a)
        if not 0 <= first <= last < total:
            raise ConfigError(f"--uids {first}-{last} is outside the job's {total} processes "
                              f"({w} ranks + {spares} spares)")
        return Layout(w, total, first, last)


def _job_name(directory: Path | str) -> str:
    """The job's arena name, kept across full restarts: CUDASNAP_JOB, else from the
    directory's absolute path."""
    from ..config import Settings

    given = Settings.from_env().job
    if given:
        return given
    key = str(directory) if isinstance(directory, str) else str(Path(directory).resolve())
    return "ipr" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _start(cmd: list[str], lay: Layout, uid: int, control: str, directory: Path | str,
           job: str, attempt: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update({"CUDASNAP_CONTROL": control, "CUDASNAP_UID": str(uid),
                "CUDASNAP_WORLD": str(lay.world), "CUDASNAP_NPROC": str(lay.nproc),
                "LOCAL_RANK": str(uid - lay.first),
                "LOCAL_WORLD_SIZE": str(lay.last - lay.first + 1),
                "CUDASNAP_DIR": str(directory), "CUDASNAP_JOB": job,
                "CUDASNAP_RESTART": str(attempt)})
    return subprocess.Popen(cmd, env=env,
                            preexec_fn=parent_death_signal(signal.SIGTERM, os.getpid()))


def _store(host: str, port: int, serve: bool) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=serve, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


def _wait(procs: dict[int, subprocess.Popen[bytes]], store: Any,
          stop: list[int]) -> tuple[str, dict[int, int | None]]:
    """Until every process ended, or the store says the in-process restart gave up (its
    processes still running then get ``_GRACE_S``, then SIGKILL). Returns the verdict,
    "done", "failed: <why>", "ended: <why>" or "stopped", and each uid's exit status."""
    seen: dict[int, int | None] = {}
    failed_at: float | None = None
    why = ""
    while True:
        now = str(time.time())
        for uid, p in procs.items():
            rc = p.poll()
            if rc is None:
                store.set(f"lhb/{uid}", now)  # alive, even while its own beat cannot run
            elif uid not in seen:
                store.set(f"gone/{uid}", str(rc))  # dead at once, on every node
                seen[uid] = rc
                if rc != 0:
                    log.warning("uid %d (pid %d) ended with %s; the in-process restart "
                                "replaces it if a spare is left", uid, p.pid,
                                f"signal {-rc}" if rc < 0 else f"exit {rc}")
        if len(seen) == len(procs):
            break
        if stop:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(stop[0])
            for uid, p in procs.items():
                seen[uid] = p.wait()
            return "stopped", seen
        if failed_at is None and store.check(["failed"]):
            failed_at, why = time.monotonic(), store.get("failed").decode()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        time.sleep(_POLL_S)
    if store.check(["done"]):  # the members of the last generation decide (the lost
        gen = store.get("done").decode()  # and the spares not needed do not)
        members = {int(u) for u in json.loads(store.get(f"members/{gen}"))}
        if all(rc == 0 for u, rc in seen.items() if u in members):
            return "done", seen
    if why or store.check(["failed"]):
        return f"failed: {why or store.get('failed').decode()}", seen
    bad = {u: rc for u, rc in seen.items() if rc != 0}
    return f"ended: the job's processes ended without finishing (exit status {bad})", seen


def launch(cmd: list[str], directory: Path | str, lay: Layout, *, max_restarts: int = 3,
           control: str | None = None, host_control: bool = False) -> int:
    """Runs ``cmd`` as the processes ``lay`` names until the job is done; returns 0, or
    the first failing exit status once the full restarts are used up."""
    job = _job_name(directory)
    stop: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        stop.append(sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(max_restarts + 1):
            if control is None:  # hosted here, a new one per attempt: no key of the last
                store = _store("127.0.0.1", 0, serve=True)
                addr = f"127.0.0.1:{store.port}"
            else:
                host, _, port = control.rpartition(":")
                store, addr = _store(host, int(port), serve=host_control), control
            procs = {u: _start(cmd, lay, u, addr, directory, job, attempt)
                     for u in range(lay.first, lay.last + 1)}
            log.info("in-process job %s, attempt %d: %d rank(s), %d process(es) here (uids "
                     "%d-%d), control store %s", job, attempt, lay.world, len(procs),
                     lay.first, lay.last, addr)
            verdict, rcs = _wait(procs, store, stop)
            if verdict == "done":
                return 0
            if verdict == "stopped":
                return 128 + stop[0]
            bad = next((rc for rc in rcs.values() if rc), 1)
            code = 128 - bad if bad < 0 else bad
            if control is not None:
                log.error("%s; with a shared control store the full restart is the "
                          "scheduler's (exit %d)", verdict, code)
                return code
            if attempt == max_restarts:
                log.error("%s; %d full restart(s) used: giving up (exit %d)", verdict,
                          max_restarts, code)
                return code
            log.warning("%s: full restart %d of %d (every process starts again and restores "
                        "from shared memory)", verdict, attempt + 1, max_restarts)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
