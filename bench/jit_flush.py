"""Just-in-time flush and crash recovery, end to end in real processes (issue 4).

For each state size it runs ONE supervised job (``cudasnap.supervisor.loop.supervise``) whose
training child (this file with ``--child``: a model-like state of params + AdamW,
``Snapshotter`` with ``CUDASNAP_HEALTH=1``, a boundary every step) goes through:

1. **injected GPU fault**: ``CUDASNAP_INJECT="xid=79@step=A1,xid=79@step=A2,..."``
   (policy ``xid=flush`` so the same child takes every repeat; the flush path is
   the one a fatal Xid takes: no wait for the copy in flight). Training goes on
   while the flush runs, as it would on the host side.
2. **SIGTERM** (preemption) sent by this process; policy ``sigterm=flush`` and a
   no-op SIGTERM handler in the child keep it alive for the next repeat (the
   flush path is the default one: it first waits for the copy in flight).
3. **kill -9** under the supervisor, ``repeats`` times restoring from shared
   memory and ``repeats`` times from disk (the restarted child deletes the arena
   before it starts): from the child's death to its first resumed step, split
   into the supervisor's orphan flush, process start, state build, restore and
   first step.

Per trigger: trigger -> flush start (target < 100 ms) and trigger -> durable
(flush-log entry), next to a raw write+fsync of the same staged bytes measured
in the same run, while the child is held at a gate (no copy running):
``os.write`` + fsync and ``_C.write_buffer_file`` with 1 thread. Target:
durable no slower than 1/0.8 of the raw write.

    python bench/jit_flush.py [--sizes 1,4] [--repeats 3] [--quick] [--json]

``--direct`` (issue 15, target 4): no training child; in this one process the
flusher (``_C.write_buffer_file``: per-chunk CRC32C + pwrite threads +
fdatasync, then the directory fsync a flush does) and a raw ``os.write`` +
fsync of the same bytes alternate ``--repeats`` times (order rotating), quiet
and with ``--load-threads`` threads memcpy-ing 256 MiB blocks meanwhile (the
boundary copies of a training loop that goes on during an Xid flush). Write and
fsync phases are timed apart for both.

    python bench/jit_flush.py --direct [--sizes 1] [--repeats 5] [--load-threads 1]
"""
from __future__ import annotations

T_MAIN = __import__("time").time()  # first thing: the child's "process is running" mark

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# Every boundary copies (what these figures measure): the default overhead budget would
# skip boundaries once it has measured the cost (cudasnap.core.cadence). Old trees ignore it.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")

N_PARAMS = 2  # "few" shape: 2 params -> 8 state tensors


# =================================================================== child
class _Events:
    def __init__(self, path: str, attempt: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.attempt = attempt

    def __call__(self, ev: str, **kw: Any) -> None:
        kw.setdefault("t", time.time())
        rec = {"ev": ev, "pid": os.getpid(), "attempt": self.attempt, **kw}
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def child_main(a: Any) -> int:
    import logging

    attempt = int(os.environ.get("CUDASNAP_RESTART", "0"))
    ev = _Events(a.events, attempt)
    ev("start", t=T_MAIN)

    class H(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            ev("log", name=rec.name, msg=rec.getMessage()[:300], t=rec.created)

    lg = logging.getLogger("cudasnap")
    lg.setLevel(logging.INFO)
    lg.addHandler(H())
    import torch  # noqa: F401

    import cudasnap

    ev("imported")
    if attempt == 0:
        # A job with its own SIGTERM handler: cudasnap's handler calls it instead of exiting.
        signal.signal(signal.SIGTERM, lambda *_: None)
    model, opt = C.build_state(a.size, N_PARAMS, with_optimizer_state=(attempt == 0))
    ev("built")
    deleted = False
    if attempt > 0 and attempt % 2 == 0:  # even restarts: restore from disk
        job = os.environ["CUDASNAP_JOB"]
        shm = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
        from cudasnap.format import paths

        for p in shm.glob(paths.arena_glob(job)):
            p.unlink()
            deleted = True
    snap = cudasnap.Snapshotter(model, opt)
    if attempt == 0:
        snap.arena_ready()  # the first gate's flush needs a snapshot: arena made in the background
    t0 = time.time()
    start = snap.restore_latest()
    rst = snap.stats().get("restore") or {}
    ev("restored", start=start, source=rst.get("source"), seconds=rst.get("seconds"),
       t0=t0, arena_deleted=deleted)
    gates = set(json.loads(a.gates)) if attempt == 0 else set()
    ctl = Path(a.ctl)
    step = start
    first = True
    while True:
        if step in gates:
            snap.wait()
            ev("gate", step=step)
            while not (ctl / f"go-{step}").exists():
                time.sleep(0.002)
        opt.step()  # hooks only (grads are None): the fence runs
        time.sleep(a.step_s)  # the training compute
        snap.boundary(step)
        ev("step", step=step)
        if first and attempt > 0:
            ev("first_step", step=step)
            first = False
            if attempt >= a.last_attempt:
                snap.wait()
                snap.close()
                return 0
        step += 1


# =================================================================== parent
class Job:
    """Drives one supervised job for one size (runs in a thread next to supervise())."""

    def __init__(self, a: Any, size: float, tmp: Path) -> None:
        self.a, self.size, self.tmp = a, size, tmp
        self.dir = tmp / "ckpt"
        self.events = tmp / "events.jsonl"
        self.ctl = tmp / "ctl"
        self.ctl.mkdir()
        self.events.touch()
        R = a.repeats
        # gates: before each xid (A_k - 1), then before each SIGTERM, then before the kill
        self.xid_steps = [4 + 6 * k for k in range(R)]
        g_xid = [s - 1 for s in self.xid_steps]
        last = self.xid_steps[-1]
        self.term_gates = [last + 6 * (k + 1) for k in range(R)]
        self.kill_gate = self.term_gates[-1] + 6
        self.gates = g_xid + self.term_gates + [self.kill_gate]
        self.last_attempt = 2 * R
        self.raw: dict[str, list[float]] = {"os": [], "native": []}
        self.kills: list[dict[str, Any]] = []
        self.triggers: list[dict[str, Any]] = []
        self.error: str | None = None
        self._pos = 0
        self._evs: list[dict[str, Any]] = []

    # ---- event helpers
    def read_events(self) -> list[dict[str, Any]]:
        with open(self.events) as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind("\n") + 1
        self._pos += len(data[:end].encode())
        for line in data[:end].splitlines():
            try:
                self._evs.append(json.loads(line))
            except ValueError:
                pass
        return self._evs

    def wait_ev(self, pred: Any, timeout: float, what: str) -> dict[str, Any]:
        t_end = time.time() + timeout
        seen = 0
        while time.time() < t_end:
            evs = self.read_events()
            for e in evs[seen:]:
                if pred(e):
                    return e
            seen = len(evs)
            time.sleep(0.005)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")

    def flush_log(self) -> list[dict[str, Any]]:
        from cudasnap.storage import listing

        return listing.read_flush_log(self.dir)

    def wait_flush(self, pid: int, after: float, timeout: float) -> dict[str, Any]:
        t_end = time.time() + timeout
        while time.time() < t_end:
            for rec in self.flush_log():
                if rec.get("pid") == pid and rec.get("time", 0) > after:
                    return rec
            time.sleep(0.01)
        raise TimeoutError(f"no flush-log entry from pid {pid} after {after:.3f}")

    def raw_round(self) -> None:
        from cudasnap._native import native
        from cudasnap.format import paths

        arena = native().Arena.open(str(paths.arena_path("/dev/shm", paths.job_id(self.dir), 0)), False)
        slot = arena.newest_complete()
        n = arena.slot_info(slot)["data_bytes"]
        order = ["os", "native"] if len(self.raw["os"]) % 2 == 0 else ["native", "os"]
        for k in order:
            if k == "os":
                self.raw[k].append(C.raw_write_os(arena.data_view(slot, n), self.tmp / "raw-os.bin"))
            else:
                self.raw[k].append(C.raw_write_native(arena.data_ptr(slot), n,
                                                      self.tmp / "raw-c.bin", 1))
        self.staged_bytes = n
        del arena

    def go(self, gate: int) -> None:
        (self.ctl / f"go-{gate}").touch()

    # ---- the script
    def drive(self) -> None:
        try:
            self._drive()
        except Exception as e:  # reported in the table; supervise() is stopped by kill
            self.error = f"{type(e).__name__}: {e}"
            C.log(f"  controller error: {self.error}")
            for e2 in reversed(self.read_events()):
                if e2["ev"] == "start":
                    try:
                        os.kill(e2["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    break

    def _drive(self) -> None:
        big = 120 + self.size * 60  # generous timeouts for a slow, shared machine
        e = self.wait_ev(lambda e: e["ev"] == "restored", big, "child start")
        pid = e["pid"]
        # --- injected Xid: gate, then the step that fires the fault
        for k, s in enumerate(self.xid_steps):
            self.wait_ev(lambda e: e["ev"] == "gate" and e["step"] == s - 1, big, f"gate {s - 1}")
            self.raw_round()
            t_go = time.time()
            self.go(s - 1)
            trig = self.wait_ev(lambda e: e["ev"] == "log" and "injected fault" in e["msg"]
                                and e["t"] >= t_go - 1, big, f"xid {k}")
            rec = self.wait_flush(pid, trig["t"], big)
            self.triggers.append(self._pair("xid", trig["t"], rec, pid))
            C.log(f"  xid {k}: trigger->durable {rec['time'] - trig['t']:.3f} s")
        # --- SIGTERM at a random point of a step, copies running
        for k, g in enumerate(self.term_gates):
            self.wait_ev(lambda e: e["ev"] == "gate" and e["step"] == g, big, f"gate {g}")
            self.go(g)
            self.wait_ev(lambda e: e["ev"] == "step" and e["step"] >= g + 2, big, "2 steps")
            time.sleep(0.05 + 0.1 * k)
            t_sig = time.time()
            os.kill(pid, signal.SIGTERM)
            rec = self.wait_flush(pid, t_sig, big)
            self.triggers.append(self._pair("sigterm", t_sig, rec, pid))
            C.log(f"  sigterm {k}: trigger->durable {rec['time'] - t_sig:.3f} s")
        # --- kill -9 chain: attempt 0 at its last gate, then each restarted child
        self.wait_ev(lambda e: e["ev"] == "gate" and e["step"] == self.kill_gate, big, "kill gate")
        self.raw_round()
        self.go(self.kill_gate)
        self.wait_ev(lambda e: e["ev"] == "step" and e["step"] >= self.kill_gate + 1, big, "step")
        self._kill(pid, 0)
        for attempt in range(1, self.last_attempt + 1):
            e = self.wait_ev(lambda e: e["ev"] == "first_step" and e["attempt"] == attempt,
                             4 * big, f"first resumed step of attempt {attempt}")
            pid = e["pid"]
            if attempt < self.last_attempt:
                # one more boundary, so the newest COMPLETE step is not on disk yet
                first = e["step"]
                self.wait_ev(lambda e: e["ev"] == "step" and e["pid"] == pid
                             and e["step"] >= first + 1, big, "one more step")
                self._kill(pid, attempt)

    def _kill(self, pid: int, attempt: int) -> None:
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        self.kills.append({"attempt": attempt, "pid": pid, "t_kill": t})

    def _pair(self, kind: str, t_trig: float, rec: dict[str, Any], pid: int) -> dict[str, Any]:
        evs = self.read_events()
        disp = next((e["t"] for e in evs if e["ev"] == "log" and e["pid"] == pid
                     and e["msg"].startswith(f"trigger {kind}") and e["t"] >= t_trig - 0.5), None)
        start = rec["time"] - rec["seconds"]
        return {"kind": kind, "t_trigger": t_trig, "t_dispatch": disp, "t_flush_start": start,
                "t_durable": rec["time"], "flush_seconds": rec["seconds"],
                "write_seconds": rec.get("write_seconds"), "fsync_seconds": rec.get("fsync_seconds"),
                "bytes": rec["bytes"], "step": rec.get("step")}

    # ---- recovery breakdown
    def recoveries(self, report: list[dict[str, Any]]) -> list[dict[str, Any]]:
        evs = self.read_events()
        by_pid: dict[int, dict[str, Any]] = {}
        for e in evs:
            d = by_pid.setdefault(e["pid"], {})
            if e["ev"] in ("start", "imported", "built", "first_step") and e["ev"] not in d:
                d[e["ev"]] = e["t"]
            if e["ev"] == "start":
                d["attempt"] = e["attempt"]
            if e["ev"] == "restored":
                d.update(restored=e["t"], restore_t0=e["t0"], source=e["source"],
                         restore_s=e["seconds"], arena_deleted=e["arena_deleted"])
        att = {d.get("attempt"): d for d in by_pid.values()}
        rep = {r["attempt"]: r for r in report}
        out = []
        for k in self.kills:
            nxt = att.get(k["attempt"] + 1)
            sup = rep.get(k["attempt"], {})
            if not nxt or "first_step" not in nxt:
                continue
            fl = [f for f in sup.get("flushed", []) if not f.get("skipped")]
            out.append({
                "source": nxt.get("source"), "arena_deleted": nxt.get("arena_deleted"),
                "total": nxt["first_step"] - k["t_kill"],
                "notice": sup.get("died", k["t_kill"]) - k["t_kill"],
                "orphan_flush": (sup.get("flush_done", 0) - sup.get("died", 0)) if sup else None,
                "orphan_flushed_bytes": sum(f.get("bytes", 0) for f in fl),
                "spawn_to_main": nxt["start"] - sup.get("flush_done", k["t_kill"]),
                "imports": nxt["imported"] - nxt["start"],
                "build": nxt["built"] - nxt["imported"],
                "snapshotter_init": nxt["restore_t0"] - nxt["built"],
                "restore": nxt["restored"] - nxt["restore_t0"],
                "first_step": nxt["first_step"] - nxt["restored"],
            })
        return out


def run_size(size_gb: float, a: Any, tmp_root: Path) -> dict[str, Any] | None:
    from cudasnap._native import native
    from cudasnap.supervisor.loop import supervise

    native()  # torch + the engine loaded here, not in the controller thread

    # child: state S + arena 2S + restore copies (~1.3S) ; old + new arena never coexist
    size = C.fit_size(size_gb, ram_per_gb=4.5, shm_per_gb=2.1, what="jit_flush")
    if size is None:
        return None
    tmp = tmp_root / f"size-{size:g}"
    tmp.mkdir()
    a.size = size
    job = Job(a, size, tmp)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--size", str(size),
           "--events", str(job.events), "--ctl", str(job.ctl), "--gates", json.dumps(job.gates),
           "--step-s", str(a.step_s), "--last-attempt", str(job.last_attempt)]
    inject = ",".join(f"xid=79@step={s}" for s in job.xid_steps)
    report: list[dict[str, Any]] = []
    C.log(f"size {size:g} GB: supervised job, {a.repeats} xid + {a.repeats} SIGTERM flushes, "
          f"{job.last_attempt} kill -9 recoveries")
    th = threading.Thread(target=job.drive, daemon=True)
    th.start()
    t0 = time.time()
    rc = supervise(cmd, job.dir, max_restarts=job.last_attempt, inject_first=inject,
                   extra_env={"CUDASNAP_POLICY": "xid=flush,sigterm=flush",
                              "PYTHONWARNINGS": "ignore"}, report=report)
    th.join(timeout=30)
    res = {"size_gb": size, "rc": rc, "wall_s": time.time() - t0, "raw": job.raw,
           "triggers": job.triggers, "recoveries": job.recoveries(report), "error": job.error,
           "staged_bytes": getattr(job, "staged_bytes", None)}
    from cudasnap.format import paths

    # The job id names the arena; it comes from the directory's id file, so take it
    # before the directory goes.
    arenas = list(Path("/dev/shm").glob(paths.arena_glob(paths.job_id(job.dir))))
    C.rm(tmp)
    for p in arenas:
        p.unlink(missing_ok=True)
    C.free_mem()
    return res


def report(results: list[dict[str, Any]]) -> str:
    f, m = C.fmt, C.med
    out = []
    rows = []
    for r in results:
        ro, rn = m(r["raw"]["os"]), m(r["raw"]["native"])
        best = min(x for x in (ro, rn) if x is not None) if (ro or rn) else None
        for kind in ("xid", "sigterm"):
            ts = [t for t in r["triggers"] if t["kind"] == kind]
            if not ts:
                continue
            disp = m([(t["t_dispatch"] - t["t_trigger"]) * 1e3 for t in ts if t["t_dispatch"]])
            start = m([(t["t_flush_start"] - t["t_trigger"]) * 1e3 for t in ts])
            dur = m([t["t_durable"] - t["t_trigger"] for t in ts])
            fl = m([t["flush_seconds"] for t in ts])
            rows.append([f"{r['size_gb']:g} GB", kind, len(ts), f(disp, " ms"), f(start, " ms"),
                         "yes" if start is not None and start < 100 else "NO", f(fl, " s"),
                         f(dur, " s"), f(ro, " s"), f(rn, " s"), f(C.ratio(ro, dur), "x"),
                         f(C.ratio(rn, dur), "x"),
                         "yes" if best and dur and best / dur >= 0.8 else "NO"])
    out.append(C.print_table(
        "Trigger -> durable (median; raw writes of the same staged bytes, same run)",
        ["size", "trigger", "n", "-> dispatch", "-> flush start", "< 100 ms?", "flush (write_slot)",
         "trigger -> durable", "raw os.write+fsync", "raw _C 1 thr", "raw(os)/durable",
         "raw(_C)/durable", ">= 0.8 of best raw?"], rows,
        "xid: from the health source's report of the injected fault (policy xid=flush; the flush "
        "does not wait for the copy in flight, training goes on meanwhile). sigterm: from "
        "os.kill in this process; the flush first waits for the copy in flight. durable = the "
        "flush-log entry, written after data+manifest fsync, rename, `latest` and directory fsyncs."))
    rows = []
    for r in results:
        for src in ("shm", "disk"):
            rs = [x for x in r["recoveries"] if x["source"] == src]
            if not rs:
                continue
            bare = m([x["imports"] + x["build"] for x in rs])
            tot = m([x["total"] for x in rs])
            ro = m(r["raw"]["os"])
            rows.append([f"{r['size_gb']:g} GB", src, len(rs), f(m([x["notice"] for x in rs]), " s"),
                         f(m([x["orphan_flush"] for x in rs]), " s"),
                         f(m([x["spawn_to_main"] for x in rs]), " s"), f(bare, " s"),
                         f(m([x["snapshotter_init"] for x in rs]), " s"),
                         f(m([x["restore"] for x in rs]), " s"),
                         f(m([x["first_step"] for x in rs]), " s"), f(tot, " s"),
                         f(C.ratio(tot, bare), "x"), f(C.ratio(tot, ro), "x")])
    out.append(C.print_table(
        "Recovery after kill -9 under cudasnap.supervisor.loop.supervise (median)",
        ["size", "restored from", "n", "death -> supervisor sees it", "orphan flush",
         "respawn -> main()", "imports + state build (bare restart)", "Snapshotter()",
         "restore_latest()", "restore -> first step done", "death -> first resumed step",
         "total / bare restart", "total / raw write"], rows,
        "disk: the restarted child deletes the arena before it starts (so its first boundary "
        "also creates and pre-faults a new arena). The supervisor flushes the dead child's "
        "newest COMPLETE slot (newer than disk) before it restarts the command."))
    for r in results:
        if r.get("error") or r.get("rc"):
            print(f"!! size {r['size_gb']:g} GB: supervise rc={r['rc']} error={r['error']}")
    return "\n".join(out)


# =================================================================== --direct
def _raw_split(view: memoryview, path: Path) -> tuple[float, float]:
    """os.write loop + fsync; (total, fsync part) seconds."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        off, n = 0, len(view)
        while off < n:
            off += os.write(fd, view[off:off + (1 << 30)])
        f0 = time.perf_counter()
        os.fsync(fd)
        f1 = time.perf_counter()
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    C.drop_cache(path)
    C.rm(path)
    return dt, f1 - f0


class _CopyLoad:
    """Threads copying 256 MiB blocks back and forth (numpy copies release the GIL)."""

    def __init__(self, threads: int) -> None:
        import numpy as np

        self.stop = threading.Event()
        self.bufs = [(np.ones(256 << 20, np.uint8), np.empty(256 << 20, np.uint8))
                     for _ in range(threads)]
        self.ths = [threading.Thread(target=self._run, args=(b,), daemon=True) for b in self.bufs]
        self.copied = 0

    def _run(self, pair: Any) -> None:
        import numpy as np

        src, dst = pair
        while not self.stop.is_set():
            np.copyto(dst, src)
            self.copied += len(src)

    def __enter__(self) -> "_CopyLoad":
        for t in self.ths:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.ths:
            t.join()


def direct_size(size_gb: float, a: Any, tmp: Path) -> dict[str, Any] | None:
    import numpy as np

    from cudasnap._native import native

    n_ = native()
    size = C.fit_size(size_gb, ram_per_gb=1.3, shm_per_gb=0.0, what="jit_flush --direct")
    if size is None:
        return None
    nbytes = int(size * C.GB)
    buf = np.empty(nbytes, np.uint8)
    buf[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # non-zero pages, not sparse
    view = memoryview(buf)
    ptr = buf.ctypes.data
    threads = a.flush_threads or min(8, max(2, os.cpu_count() or 1))
    chunk = 4 * C.MiB
    res: dict[str, Any] = {"size_gb": size, "bytes": nbytes, "threads": threads, "cases": {}}
    for load in sorted({0, a.load_threads}):
        rec: dict[str, list[float]] = {k: [] for k in ("flush", "flush_fsync", "raw", "raw_fsync",
                                                       "flush_1thr", "flush_1thr_fsync")}
        with (_CopyLoad(load) if load else _NoLoad()):
            for r in range(a.repeats):
                order = ["flush", "raw", "flush_1thr"]
                order = order[r % 3:] + order[:r % 3]
                for k in order:
                    if k == "raw":
                        dt, fs = _raw_split(view, tmp / "raw.bin")
                        rec["raw"].append(dt)
                        rec["raw_fsync"].append(fs)
                        continue
                    d = tmp / f"step-{r}.tmp"
                    d.mkdir()
                    t0 = time.perf_counter()
                    st = n_.write_buffer_file(ptr, nbytes, chunk, str(d / "data.bin"),
                                              1 if k == "flush_1thr" else threads, 16 * C.MiB, True)
                    n_.fsync_dir(str(d))
                    rec[k].append(time.perf_counter() - t0)
                    rec[k + "_fsync"].append(st["fsync_seconds"])
                    C.drop_cache(d / "data.bin")
                    C.rm(d)
        res["cases"][f"load={load}"] = rec
        C.log(f"  {size:g} GB load={load}: flush {C.med(rec['flush']):.3f} s, "
              f"raw {C.med(rec['raw']):.3f} s")
    del buf, view
    C.free_mem()
    return res


class _NoLoad:
    def __enter__(self) -> "_NoLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def direct_report(results: list[dict[str, Any]]) -> str:
    f, m = C.fmt, C.med
    rows = []
    for r in results:
        for case, rec in r["cases"].items():
            raw = m(rec["raw"])
            for k, label in (("flush", f"{r['threads']} thr"), ("flush_1thr", "1 thr")):
                fl = m(rec[k])
                rows.append([f"{r['size_gb']:g} GB", case, label, len(rec[k]), f(fl, " s"),
                             f(m(rec[k + "_fsync"]), " s"), f(raw, " s"), f(m(rec["raw_fsync"]), " s"),
                             f(C.ratio(raw, fl), "x"),
                             "yes" if raw and fl and raw / fl >= 0.8 else "NO"])
    return C.print_table(
        "Flusher vs raw os.write+fsync, same bytes, same process, alternating (median)",
        ["size", "copy load", "flusher", "n", "flush (write+CRC+fdatasync+dir fsync)",
         "of which fdatasync", "raw os.write+fsync", "of which fsync", "raw / flush",
         ">= 0.8?"], rows,
        "copy load=k: k threads memcpy 256 MiB blocks during BOTH the flush and the raw write.")


def parse_args(argv: list[str] | None = None) -> Any:
    p = C.base_parser(__doc__.split("\n\n")[0], quick_sizes="0.1")
    p.add_argument("--step-s", type=float, default=0.2, help="simulated compute per step (s)")
    p.add_argument("--direct", action="store_true",
                   help="in-process flusher vs raw write+fsync, alternating (no training child)")
    p.add_argument("--load-threads", type=int, default=1,
                   help="--direct: memcpy threads running during the second set of rounds")
    p.add_argument("--flush-threads", type=int, default=0,
                   help="--direct: flusher threads (default: as Snapshotter)")
    p.add_argument("--child", action="store_true", help=argparse_suppress())
    p.add_argument("--size", type=float, help=argparse_suppress())
    p.add_argument("--events", help=argparse_suppress())
    p.add_argument("--ctl", help=argparse_suppress())
    p.add_argument("--gates", default="[]", help=argparse_suppress())
    p.add_argument("--last-attempt", type=int, default=0, help=argparse_suppress())
    a = p.parse_args(argv)
    if not a.child:
        C.finish_args(a)
    return a


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    tmp = C.disk_tmpdir(a.tmp, "jit")
    print(f"# jit_flush: {time.strftime('%Y-%m-%d %H:%M:%S')}; {C.machine_line()}; "
          f"disk dir {C.disk_line(tmp)}", flush=True)
    print(f"# sizes {a.sizes} GB, repeats {a.repeats}, step {a.step_s} s + copy\n", flush=True)
    t0 = time.perf_counter()
    results = []
    if a.direct:
        try:
            for s in a.sizes:
                r = direct_size(s, a, tmp)
                if r is not None:
                    results.append(r)
        finally:
            C.rm(tmp)
        direct_report(results)
        print(f"total wall time {time.perf_counter() - t0:.0f} s", flush=True)
        if a.json:
            C.emit_json({"bench": "jit_flush_direct", "results": results})
        return 0
    try:
        for s in a.sizes:
            r = run_size(s, a, tmp)
            if r is not None:
                results.append(r)
    finally:
        C.rm(tmp)
    report(results)
    print(f"total wall time {time.perf_counter() - t0:.0f} s", flush=True)
    if a.json:
        C.emit_json({"bench": "jit_flush", "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
