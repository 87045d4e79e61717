"""The fault matrix: damage snapshots every way we know, restore, and judge the outcome.

Used by tests/e2e/test_faults.py (a bounded run) and bench/faults.py (the whole
matrix, more seeds, and the table in bench/RESULTS.md). Every case ends in a
``Case`` record:

* ``expected``: the step a restore must come back with: the newest snapshot
  the fault did not touch (None: nothing loadable, a fresh start);
* ``got``: the step restore_latest() came back with (None: fresh start);
* ``lost``: a snapshot the fault did not touch was not loaded (got < expected);
* ``torn``: the restored state is not bitwise the state recorded at step ``got``
  (a mix of steps, a damaged byte that loaded, a damaged newer snapshot);
* ``named``: the warning or error that reported the fault names the damaged
  file (or arena) -- required where the fault hit the newest snapshot.

Families: disk (truncate / flip data.bin and manifest.json, delete latest,
files, directories), shm (flip bytes of slot headers, meta, CRC table, data and
the arena header), dist (rank directories and COMMIT markers of a 2-rank
layout, restored by two gloo processes), diskfull (a small tmpfs: data,
manifest or ``latest`` does not fit), shmfull (a tiny or full staging tmpfs),
kill (SIGKILL at every phase of copy and flush through the test-only hook
CUDASNAP_TEST_KILL_AT), lock (two jobs on one directory, a dead job's lock), export
(SIGKILL of `cudasnap export` at a random moment: the target holds a whole export).

Families in other modules (bench/faults.py runs them too): supervisor (`cudasnap run`
kills, full disk, shared directories: supervisor.py), and issue 23's edges:
endjob (the end of a 2-rank job with a late, stuck or dead rank) and jobmismatch (ranks
restoring with different jobs) in endjob.py; escape (the supervisor or its
process group SIGKILLed after a warm restart), config (a /dev/shm too small under
`cudasnap run`) and stop (a SIGSTOPped attempt under --watchdog) in supervisor.py.
``Case.ok`` is False when such a case's other condition failed (a wait over its bound).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:  # run as a script (the dist-rank processes)
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import cudasnap  # noqa: E402
from cudasnap._native import native  # noqa: E402
from cudasnap._testing import faults  # noqa: E402
from cudasnap.errors import CorruptSnapshot, FlushError, StagingError  # noqa: E402
from cudasnap.format import paths  # noqa: E402
from cudasnap.snapshotter import Snapshotter  # noqa: E402
from cudasnap.storage import posix  # noqa: E402
from cudasnap.storage.latest import read_latest  # noqa: E402
from tools.faults import layout as L  # noqa: E402
from tools.faults.trainlib import Job  # noqa: E402
from tools.faults.zygote import LineServer  # noqa: E402

DIM = 64  # ~100 KB of state: 25 chunks of 4 KiB
CHUNK = 4096
STEPS = 3


# ------------------------------------------------------------------ records

@dataclass
class Case:
    family: str
    name: str
    expected: int | None
    got: int | None = None
    torn: bool = False
    named: bool = True
    need_named: bool = True
    detail: str = ""
    error: str = ""  # an unexpected exception: the case failed outright
    ok: bool = True  # the case's other conditions (a bound on a wait, ...) held

    @property
    def lost(self) -> bool:
        return self.expected is not None and (self.got is None or self.got < self.expected)

    @property
    def recovered(self) -> bool:
        return (not self.error and not self.lost and not self.torn and self.got == self.expected
                and (self.named or not self.need_named) and self.ok)

    def line(self) -> str:
        return (f"{self.family}/{self.name}: expected {self.expected} got {self.got}"
                f"{' TORN' if self.torn else ''}{' LOST' if self.lost else ''}"
                f"{'' if self.named or not self.need_named else ' (not named)'}"
                f"{'' if self.ok else ' (condition not met)'}"
                f"{' ERROR ' + self.error if self.error else ''} {self.detail}")


def table(cases: list[Case]) -> str:
    fams: dict[str, list[Case]] = {}
    for c in cases:
        fams.setdefault(c.family, []).append(c)
    rows = [("family", "faults", "recovered", "lost", "torn", "named", "errors")]
    tot = [0, 0, 0, 0, 0, 0]
    for fam, cs in fams.items():
        r = [len(cs), sum(c.recovered for c in cs), sum(c.lost for c in cs),
             sum(c.torn for c in cs), sum(c.named for c in cs if c.need_named),
             sum(bool(c.error) for c in cs)]
        need = sum(c.need_named for c in cs)
        rows.append((fam, str(r[0]), str(r[1]), str(r[2]), str(r[3]), f"{r[4]}/{need}", str(r[5])))
        tot = [a + b for a, b in zip(tot, r)]
    need = sum(c.need_named for c in cases)
    rows.append(("total", str(tot[0]), str(tot[1]), str(tot[2]), str(tot[3]), f"{tot[4]}/{need}",
                 str(tot[5])))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(r[i].ljust(w[i]) for i in range(len(r))) + " |" for r in rows]
    out.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    return "\n".join(out)


# -------------------------------------------------------------------- context

@dataclass
class Ctx:
    """Where a run of the matrix works: a scratch dir, the staging dir, a job prefix."""

    root: Path
    prefix: str
    shm: Path = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
    _n: Any = field(default_factory=itertools.count)
    mounts: list[Path] = field(default_factory=list)

    def job(self, tag: str) -> str:
        return f"{self.prefix}-{tag}{next(self._n)}"

    def dir(self, tag: str) -> Path:
        return self.root / f"{tag}-{next(self._n)}"

    def arena(self, job: str, rank: int = 0) -> Path:
        return self.shm / f"cudasnap-{job}-r{rank}.arena"

    def cleanup(self) -> None:
        for m in list(self.mounts):
            umount(m)
        for p in self.shm.glob(f"cudasnap-{self.prefix}*"):
            p.unlink(missing_ok=True)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:  # noqa: BLE001
            self.messages.append(str(record.msg))


@contextlib.contextmanager
def capture_warnings() -> Iterator[_Capture]:
    h = _Capture()
    lg = logging.getLogger("cudasnap")
    old = lg.level
    lg.addHandler(h)
    if lg.level == logging.NOTSET or lg.level > logging.WARNING:
        lg.setLevel(logging.WARNING)
    try:
        yield h
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


def digests_equal(a: dict, b: dict) -> bool:
    return a == b


def restore(ctx: Ctx, directory: Path, job: str, dim: int = DIM, **kw: Any
            ) -> tuple[int | None, dict, list[str]]:
    """A fresh Job restored by a fresh Snapshotter: (step restored or None, digests, warnings)."""
    j = Job(dim=dim)
    with capture_warnings() as cap:
        snap = Snapshotter(j.model, j.opt, directory=directory, job=job, extra=j.extra(),
                           chunk_bytes=CHUNK, copy_threads=1, shm_dir=ctx.shm, **kw)
        try:
            start = snap.restore_latest()
        finally:
            snap.close()
    return (start - 1 if start else None), j.digests(), cap.messages


def judge(case: Case, got: int | None, digests: dict, refs: dict[int, dict],
          messages: list[str], names: list[str]) -> Case:
    case.got = got
    if got is not None:
        case.torn = not digests_equal(digests, refs.get(got, {}))
    text = "\n".join(messages)
    case.named = any(n in text for n in names) if names else True
    if not case.named:
        case.detail += f" warnings: {messages[-3:]}"
    return case


def guarded(case: Case, fn: Callable[[], Case]) -> Case:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a case that crashed is reported, not raised
        case.error = f"{type(e).__name__}: {e}"
        return case


# ----------------------------------------------------------------- baselines

@dataclass
class Base:
    dir: Path
    job: str
    refs: dict[int, dict]
    arena: Path | None = None


def build_base(ctx: Ctx, *, flush_steps: tuple[int, ...] = (0, 1, 2), keep_arena: bool = False,
               steps: int = STEPS, dim: int = DIM) -> Base:
    """Trains ``steps`` steps in this process, snapshotting each, flushing ``flush_steps``."""
    d = ctx.dir("base")
    job = ctx.job("base")
    j = Job(dim=dim)
    refs = {}
    snap = Snapshotter(j.model, j.opt, directory=d, job=job, extra=j.extra(), chunk_bytes=CHUNK,
                       copy_threads=1, keep=10, shm_dir=ctx.shm)
    try:
        for k in range(steps):
            j.step()
            refs[k] = j.digests()
            snap.boundary(k)
            snap.wait()
            if k in flush_steps:
                snap.flush()
    finally:
        snap.close(keep_arena=keep_arena)
    return Base(d, job, refs, ctx.arena(job) if keep_arena else None)


def clone_dir(ctx: Ctx, base: Base) -> Path:
    d = ctx.dir("case")
    shutil.copytree(base.dir, d, symlinks=True)
    for p in d.glob(".lock*"):
        p.unlink()
    return d


def clone_arena(ctx: Ctx, base: Base, job: str) -> Path:
    assert base.arena is not None
    dst = ctx.arena(job)
    shutil.copyfile(base.arena, dst)
    os.chmod(dst, 0o600)
    return dst


def step_dir(d: Path, step: int) -> Path:
    return d / paths.step_dirname(step)


# ------------------------------------------------------------ family: disk

def disk_cases(ctx: Ctx, base: Base, n_trunc: int = 60, n_flip: int = 40,
               seed: int = 1) -> list[Case]:
    rng = random.Random(seed)
    out: list[Case] = []
    newest = max(base.refs)

    def run(name: str, damage: Callable[[Path], tuple[int | None, list[str]]],
            refusal_ok: bool = False) -> Case:
        """``refusal_ok``: every snapshot's first chunk is damaged, so nothing is restored,
        and either the job starts over (nothing was applied) or, loudly, refuses to
        (CorruptSnapshot naming the snapshot that failed half-way through being applied).
        Which one depends on timing, not on a bug: the readers verify and copy chunks in
        parallel, so a later chunk, verified, may land before the reader of the first chunk
        finds it bad (CI at 95db363, 2026-12-06). Never a resume."""
        case = Case("disk", name, None)

        def body() -> Case:
            d = clone_dir(ctx, base)
            case.expected, names = damage(d)
            try:
                got, dig, msgs = restore(ctx, d, ctx.job("r"))
            except CorruptSnapshot as e:
                if not refusal_ok or "failed half-way through being applied" not in str(e) \
                        or "no snapshot could be restored" not in str(e):
                    raise
                case.detail = "refused to start over (a later chunk had landed)"
                return case  # got None == expected None: nothing resumed, said loudly
            return judge(case, got, dig, base.refs, msgs, names)
        return guarded(case, body)

    for _ in range(n_trunc):
        fname = rng.choice([paths.DATA, paths.MANIFEST])
        target = newest if rng.random() < 0.75 else newest - 1
        size = (step_dir(base.dir, target) / fname).stat().st_size
        off = rng.randrange(0, size)

        def trunc(d: Path, fname=fname, target=target, off=off):
            f = step_dir(d, target) / fname
            os.truncate(f, off)
            exp = newest - 1 if target == newest else newest
            return exp, [str(f)] if target == newest else []
        out.append(run(f"truncate {fname} of step {target} at {off}", trunc))

    for _ in range(n_flip):
        fname = rng.choice([paths.DATA, paths.MANIFEST])
        target = newest if rng.random() < 0.75 else newest - 1
        size = (step_dir(base.dir, target) / fname).stat().st_size
        off = rng.randrange(0, size)
        mask = rng.randrange(1, 256)

        def flip(d: Path, fname=fname, target=target, off=off, mask=mask):
            f = step_dir(d, target) / fname
            before = f.read_bytes()
            L.flip_byte(f, off, mask)
            harmless = False
            if fname == paths.MANIFEST:
                try:  # a flip that re-parses to the very same manifest (e.g. hex case of a \\u escape)
                    harmless = json.loads(f.read_bytes()) == json.loads(before)
                except ValueError:
                    harmless = False
            if harmless or target != newest:
                return newest, []
            return newest - 1, [str(f)]
        out.append(run(f"flip {fname} of step {target} at {off} ^{mask:#04x}", flip))

    def rm(rel: str, exp: int, names: Callable[[Path], list[str]] = lambda d: []):
        def damage(d: Path):
            for r in rel.split("+"):
                p = d / r
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            return exp, names(d)
        return damage

    s_new, s_old = paths.step_dirname(newest), paths.step_dirname(newest - 1)
    out.append(run("delete latest", rm("latest", newest)))
    out.append(run(f"delete {s_new}/manifest.json",
                   rm(f"{s_new}/manifest.json", newest - 1,
                      lambda d: [str(d / s_new / "manifest.json")])))
    out.append(run(f"delete {s_new}/data.bin",
                   rm(f"{s_new}/data.bin", newest - 1, lambda d: [str(d / s_new / "data.bin")])))
    out.append(run(f"delete {s_new}/", rm(s_new, newest - 1)))
    out.append(run(f"delete latest + {s_new}/", rm(f"latest+{s_new}", newest - 1)))
    out.append(run(f"delete {s_old}/data.bin (older)", rm(f"{s_old}/data.bin", newest)))

    def dangling(d: Path):
        (d / "latest").write_text("step-00000099\n")
        return newest, []
    out.append(run("latest names a missing step", dangling))

    def all_bad(d: Path):
        for s in posix.list_snapshots(d):
            L.flip_byte(s.path / paths.DATA, 100, 0x10)
        return None, [str(d / s_new / paths.DATA)]
    out.append(run("every data.bin damaged", all_bad, refusal_ok=True))
    return out


# -------------------------------------------------------------- family: shm

def shm_cases(ctx: Ctx, base: Base, n: int = 24, seed: int = 2) -> list[Case]:
    """``base``: steps 0..2 in memory (slots hold 1 and 2), step 0 alone on disk."""
    C = native()
    rng = random.Random(seed)
    probe = C.Arena.open(str(base.arena), False)
    info = {probe.slot_info(i)["step"]: probe.slot_info(i) for i in range(probe.num_slots)}
    geo = (probe.data_capacity, probe.meta_capacity, probe.chunk_bytes)
    del probe
    newest = max(info)
    out: list[Case] = []

    def run(name: str, region: str, slot_step: int | None) -> Case:
        case = Case("shm", name, None)

        def body() -> Case:
            d = clone_dir(ctx, base)
            job = ctx.job("s")
            path = clone_arena(ctx, base, job)
            if region == "arena-header":
                off = rng.randrange(0, L.AH_SIZE)
                exp, names = 0, [str(path)]
            else:
                s = info[slot_step]
                i = s["index"]
                if region == "slot-header":
                    off = L.slot_offset(i, *geo) + rng.randrange(0, L.SH_SIZE)
                elif region == "meta":
                    off = L.meta_offset(i, *geo) + rng.randrange(0, s["meta_bytes"])
                elif region == "table":
                    off = L.table_offset(i, *geo) + rng.randrange(0, s["num_chunks"] * 4)
                else:
                    off = L.data_offset(i, *geo) + rng.randrange(0, s["data_bytes"])
                exp = newest - 1 if slot_step == newest else newest
                # restore_latest skips a slot that is not valid without a word (snapshotter.py);
                # only a data CRC failure is reported (with the arena path).
                names = [str(path)] if slot_step == newest else []
                case.need_named = region == "data" and slot_step == newest
            L.flip_byte(path, off, rng.randrange(1, 256))
            case.expected = exp
            case.detail = f"offset {off}"
            got, dig, msgs = restore(ctx, d, job)
            return judge(case, got, dig, base.refs, msgs, names)
        return guarded(case, body)

    regions = ["slot-header", "slot-header", "meta", "table", "data"]
    for k in range(n):
        region = regions[k % len(regions)]
        step = newest if k % 7 else newest - 1
        out.append(run(f"flip {region} of the step-{step} slot", region, step))
    for _ in range(3):
        out.append(run("flip arena header", "arena-header", None))
    return out


# ----------------------------------------------------------- family: kill

class Zygote(LineServer):
    """tools/faults/fault_worker.py: forks training processes that kill themselves."""

    def __init__(self) -> None:
        super().__init__(HERE / "fault_worker.py", 180.0, drop_env=(faults.KILL_ENV,),
                         stderr_lines=30)

    def next(self, timeout: float = 120.0) -> str:
        return super().next(timeout)

    def run(self, **cmd: Any) -> tuple[int, list[dict]]:
        """Runs one child to its end; returns (wait status, its records)."""
        out = Path(cmd["out"])
        self.send(cmd="run", **cmd)
        pid = int(self.next().split()[1])
        self.send(cmd="reap", pid=pid)
        status = int(self.next(300.0).split()[2])
        recs = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        return status, recs

    def close(self) -> None:
        super().close(timeout=10.0)


# phase -> (step restored with the arena, step restored from disk alone), for a
# kill during step 2's copy or flush (steps 0 and 1 flushed before).
KILL_PHASES = {
    "copy": (1, 1),      # csrc/staging.cpp commit(): data copied, header not yet written
    "header": (1, 1),    # commit(): header half written, state still WRITING
    "write": (2, 1),     # csrc/flusher.cpp: first piece of data.bin written
    "fsync": (2, 1),     # data.bin written, not yet fdatasync'd
    "manifest": (2, 1),  # posix.write_slot: manifest written, tmp dir not fsync'd
    "rename": (2, 1),    # just before the rename of step-N.tmp-<pid> to step-N
    "renamed": (2, 2),   # renamed, parent directory not yet fsync'd, latest old
    "latest": (2, 2),    # new latest written to .latest.tmp-<pid>, not yet renamed
}


def kill_cases(ctx: Ctx, zyg: Zygote, phases: list[str] | None = None,
               replace: bool = True) -> list[Case]:
    out: list[Case] = []
    for phase in list(KILL_PHASES) if phases is None else phases:
        case = Case("kill", phase, None)

        def body(phase: str = phase, case: Case = case) -> Case:
            d = ctx.dir("kill")
            job = ctx.job("k")
            status, recs = zyg.run(dir=str(d), job=job, steps=STEPS, dim=DIM,
                                   kill=f"{phase}@{STEPS}", out=str(d) + ".jsonl")
            refs = {r["step"]: r["digests"] for r in recs if "step" in r}
            errs = [r["error"] for r in recs if "error" in r]
            if errs or not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                case.error = f"victim did not die by SIGKILL (status {status}): {errs}"
                return case
            exp_shm, exp_disk = KILL_PHASES[phase]
            # Disk alone first (a copy of the directory, another job: no arena).
            d2 = ctx.dir("killdisk")
            shutil.copytree(d, d2, symlinks=True)
            got, dig, msgs = restore(ctx, d2, ctx.job("kd"))
            sub = judge(Case("kill", phase + "/disk", exp_disk), got, dig, refs, msgs, [])
            leftovers = sorted(p.name for p in d2.iterdir() if ".tmp" in p.name)
            got, dig, msgs = restore(ctx, d, job)
            case.expected = exp_shm
            judge(case, got, dig, refs, msgs, [])
            case.detail = f"disk-only: got {sub.got}"
            if sub.lost or sub.torn or sub.got != exp_disk:
                case.error = f"disk-only restore: {sub.line()}"
            if leftovers:
                case.error += f" .tmp left after restart: {leftovers}"
            return case
        out.append(guarded(case, body))

    if not replace:
        return out
    # A committed copy of a step is moved aside (.old-<pid>) while a new run's
    # copy of the same step replaces it; killed in between, the old copy must come back.
    case = Case("kill", "replace", None)

    def replace() -> Case:
        d = ctx.dir("kill")
        st, recs_a = zyg.run(dir=str(d), job=ctx.job("ka"), steps=STEPS, dim=DIM, kill=None,
                             out=str(d) + ".a.jsonl")
        assert st == 0, (st, recs_a)
        job = ctx.job("kb")
        status, recs = zyg.run(dir=str(d), job=job, steps=STEPS, dim=DIM,
                               kill=f"replace@{STEPS}", out=str(d) + ".b.jsonl")
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            case.error = f"victim did not die by SIGKILL (status {status})"
            return case
        refs = {r["step"]: r["digests"] for r in recs if "step" in r}
        refs_a = {r["step"]: r["digests"] for r in recs_a if "step" in r}
        d2 = ctx.dir("killdisk")
        shutil.copytree(d, d2, symlinks=True)
        got, dig, msgs = restore(ctx, d2, ctx.job("kd"))
        ok = got == STEPS - 1 and dig in (refs.get(got), refs_a.get(got))
        if not ok:
            case.error = f"disk-only restore got {got} (want {STEPS - 1}, the moved-aside copy)"
        got, dig, msgs = restore(ctx, d, job)
        case.expected = STEPS - 1
        return judge(case, got, dig, refs, msgs, [])
    out.append(guarded(case, replace))
    return out


# ------------------------------------------------------- family: diskfull

def mount_tmpfs(ctx: Ctx, size: str) -> Path | None:
    d = ctx.dir("fs")
    d.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        return None
    ctx.mounts.append(d)
    return d


def umount(d: Path) -> None:
    r = subprocess.run(["umount", str(d)], capture_output=True)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _free(d: Path) -> int:
    v = os.statvfs(d)
    return v.f_bavail * v.f_frsize


def fill(fs: Path, leave: int) -> Path:
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        n = _free(fs) - leave
        if n > 0:
            os.posix_fallocate(fd, 0, n)
    finally:
        os.close(fd)
    return filler


def diskfull_cases(ctx: Ctx) -> list[Case]:
    out = []
    fs_probe = mount_tmpfs(ctx, "8m")
    mode = "tmpfs" if fs_probe is not None else "rlimit"
    if fs_probe is not None:
        umount(fs_probe)
        ctx.mounts.remove(fs_probe)
    variants = ["data", "manifest", "latest"] if mode == "tmpfs" else ["data"]
    for what in variants:
        case = Case("diskfull", f"{what} does not fit ({mode})", 0 if what != "latest" else 1)
        out.append(guarded(case, lambda what=what, case=case: diskfull_case(ctx, what, mode, case)))
    return out


def diskfull_case(ctx: Ctx, what: str, mode: str, case: Case) -> Case:
    from cudasnap.triggers.guard import Guard

    fs = mount_tmpfs(ctx, "8m") if mode == "tmpfs" else ctx.dir("rl")
    assert fs is not None
    try:
        d = fs / "ckpt"
        j = Job(dim=DIM)
        refs = {}
        snap = Snapshotter(j.model, j.opt, directory=d, job=ctx.job("f"), extra=j.extra(),
                           chunk_bytes=CHUNK, copy_threads=1, keep=10, shm_dir=ctx.shm)
        try:
            for k in (0, 1):
                j.step()
                refs[k] = j.digests()
                snap.boundary(k)
                snap.wait()
                if k == 0:
                    snap.flush()
            arena = snap.staged_arenas()[0]  # its own arena
            nbytes = arena.slot_info(arena.newest_complete())["data_bytes"]
            pages = -(-nbytes // 4096)
            man_pages = -(-(d / "step-00000000" / "manifest.json").stat().st_size // 4096)
            filler = None
            old_limit = None
            if mode == "tmpfs":
                leave = {"data": pages - 1, "manifest": pages,
                         "latest": pages + man_pages}[what] * 4096
                filler = fill(fs, leave)
            else:
                old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
                old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes // 2, old_limit[1]))
            err = None
            try:
                with capture_warnings():
                    snap.flush()
            except FlushError as e:
                err = e
            finally:
                if old_limit is not None:
                    resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
                    signal.signal(signal.SIGXFSZ, old_sig)
            if err is None:
                case.error = "flush did not fail"
                return case
            msg = str(err)
            want = {"data": "data.bin", "manifest": "manifest.json", "latest": "latest"}[what]
            named = str(d) in msg and want in msg and ("No space" in msg or "too large" in msg)
            case.detail = msg[:200]
            tmp_left = [p.name for p in d.rglob("*.tmp*")]
            if tmp_left:
                case.error = f".tmp left behind: {tmp_left}"
            if read_latest(d) != "step-00000000":
                case.error += f" latest changed to {read_latest(d)}"
            # The previous snapshot (and, for "latest", the new committed one) loads.
            d2 = ctx.dir("dfcopy")
            shutil.copytree(d, d2, ignore=shutil.ignore_patterns("filler", ".lock*"))
            got, dig, msgs = restore(ctx, d2, ctx.job("fr"))
            judge(case, got, dig, refs, msgs, [])
            case.named = named
            # A trigger's flush (the guard's path) failing must not stop training.
            guard = Guard(snap, signals=False)
            with capture_warnings():
                guard.trigger("manual", "fault matrix: disk full")
            outcome = guard.history()[-1].outcome
            if mode == "tmpfs" and what != "latest" and outcome != "flush_failed":
                case.error += f" guard outcome {outcome!r}"
            j.step()
            refs[2] = j.digests()
            snap.boundary(2)
            snap.wait()
            if filler is not None:
                filler.unlink()
            path = snap.flush()
            if path is None or path.name != "step-00000002":
                case.error += f" flush after freeing space wrote {path}"
        finally:
            snap.close()
        return case
    finally:
        if mode == "tmpfs":
            umount(fs)
            ctx.mounts.remove(fs)


# -------------------------------------------------------- family: shmfull

def shmfull_cases(ctx: Ctx) -> list[Case]:
    out = []
    for what in ("tiny", "full", "env"):
        case = Case("shmfull", f"staging tmpfs {what}", None)
        out.append(guarded(case, lambda what=what, case=case: shmfull_case(ctx, what, case)))
    return out


def shmfull_case(ctx: Ctx, what: str, case: Case) -> Case:
    fs = mount_tmpfs(ctx, "256k" if what != "full" else "16m")
    if fs is None:
        case.error = "cannot mount a tmpfs here (not root?)"
        return case
    try:
        if what == "full":
            fill(fs, 64 << 10)
        j = Job(dim=DIM)
        job = ctx.job("m")
        kw: dict[str, Any] = {"shm_dir": fs}
        old_env = os.environ.get("CUDASNAP_SHM_DIR")
        if what == "env":
            kw = {}
            os.environ["CUDASNAP_SHM_DIR"] = str(fs)
        try:
            snap = Snapshotter(j.model, j.opt, directory=ctx.dir("mdir"), job=job,
                               extra=j.extra(), chunk_bytes=CHUNK, copy_threads=1, **kw)
        finally:
            if what == "env":
                if old_env is None:
                    os.environ.pop("CUDASNAP_SHM_DIR", None)
                else:
                    os.environ["CUDASNAP_SHM_DIR"] = old_env
        try:
            j.step()
            try:
                snap.boundary(0)
                case.error = "boundary() did not refuse the arena"
            except StagingError as e:
                msg = str(e)
                case.detail = msg[:200]
                case.named = (str(fs) in msg and "needs" in msg and "free of" in msg
                              and "bytes" in msg)
            leftovers = list(fs.glob("cudasnap-*"))
            if leftovers:
                case.error += f" arena file left: {leftovers}"
        finally:
            snap.close()
        case.got = None
        return case
    finally:
        umount(fs)
        ctx.mounts.remove(fs)


# ----------------------------------------------------------- family: lock

_HOLDER = """
import os, sys, time
sys.path.insert(0, {repo!r})
from cudasnap.storage.ownership import DirectoryLock
lk = DirectoryLock({d!r})
lk.acquire()
print("LOCKED", os.getpid(), flush=True)
time.sleep(600)
"""


def lock_cases(ctx: Ctx) -> list[Case]:
    out = []
    case = Case("lock", "second job on the directory (same process)", None)

    def same() -> Case:
        d = ctx.dir("lock")
        j = Job(dim=8)
        a = Snapshotter(j.model, j.opt, directory=d, job=ctx.job("l"), shm_dir=ctx.shm)
        try:
            try:
                Snapshotter(j.model, j.opt, directory=d, job=ctx.job("l"), shm_dir=ctx.shm)
                case.error = "second Snapshotter was not refused"
            except cudasnap.ConfigError as e:
                msg = str(e)
                case.detail = msg
                case.named = (str(d) in msg and f"pid={os.getpid()}" in msg
                              and f"host={socket.gethostname()}" in msg)
        finally:
            a.close()
        return case
    out.append(guarded(case, same))

    case2 = Case("lock", "live job in another process, then killed -9", None)

    def other() -> Case:
        d = ctx.dir("lock")
        d.mkdir(mode=0o700, parents=True)
        p = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=str(REPO), d=str(d))],
                             stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None
            line = p.stdout.readline().split()
            assert line and line[0] == "LOCKED", line
            pid = int(line[1])
            j = Job(dim=8)
            try:
                Snapshotter(j.model, j.opt, directory=d, job=ctx.job("l"), shm_dir=ctx.shm)
                case2.error = "Snapshotter did not refuse a directory locked by a live job"
                return case2
            except cudasnap.ConfigError as e:
                case2.named = f"pid={pid}" in str(e) and "host=" in str(e)
                case2.detail = str(e)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        with capture_warnings() as cap:
            s = Snapshotter(j.model, j.opt, directory=d, job=ctx.job("l"), shm_dir=ctx.shm)
            s.close()
        took = [m for m in cap.messages if "stale lock" in m and f"pid={pid}" in m]
        if not took:
            case2.error = f"no takeover warning naming pid {pid}: {cap.messages}"
        return case2
    out.append(guarded(case2, other))
    return out


# ----------------------------------------------------------- family: dist

DIST_DIM = 16


def _fill_rank(m: torch.nn.Module, rank: int, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.fill_(rank * 100 + step + i * 0.25)


def _who(m: torch.nn.Module) -> tuple[int, int] | None:
    """(rank, step) whose values the model holds, or None when not one consistent state."""
    ps = list(m.parameters())
    v = float(ps[0].flatten()[0])
    rank, step = int(v // 100), int(round(v - 100 * (v // 100)))
    for i, p in enumerate(ps):
        if not torch.all(p == rank * 100 + step + i * 0.25):
            return None
    return rank, step


def build_dist_layout(ctx: Ctx, steps: tuple[int, ...] = (1, 2)) -> Path:
    """DIR/step-N/rank-RRRRR/ + DIR/step-N/COMMIT + latest, as cudasnap.distributed writes."""
    from cudasnap.format.paths import COMMIT, rank_dirname

    d = ctx.dir("dist")
    for r in (0, 1):
        m = torch.nn.Linear(DIST_DIM, DIST_DIM)
        snap = Snapshotter(m, None, directory=d, job=ctx.job(f"db{r}"), rank=r, world_size=2,
                           distributed=False, chunk_bytes=CHUNK, copy_threads=1, shm_dir=ctx.shm,
                           flush_on_close=False)  # (the layout is written by hand below)
        try:
            for s in steps:
                _fill_rank(m, r, s)
                snap.boundary(s)
                snap.wait()
                a = snap.staged_arenas()[0]  # its own arena
                slot = a.newest_complete()
                a.lease(slot)
                try:
                    posix.write_slot(a, slot, d, subdir=rank_dirname(r), update_latest=False,
                                     extra_manifest={"replica_group": [r]})
                finally:
                    a.release(slot)
        finally:
            snap.close()
    for s in steps:
        sd = d / paths.step_dirname(s)
        (sd / COMMIT).write_text(json.dumps({
            "step": s, "world_size": 2, "present": [0, 1], "missing": [],
            "replica_groups": [[0], [1]], "time": time.time(), "job": "faults"}))
    (d / "latest").write_text(paths.step_dirname(max(steps)) + "\n")
    return d


# name -> (damage relative to the layout, replicas, {rank: expected (rank, step) or None})
DIST_CASES: dict[str, tuple[list[str], str, dict[int, tuple[int, int] | None]]] = {
    "intact": ([], "none", {0: (0, 2), 1: (1, 2)}),
    "delete latest": (["rm latest"], "none", {0: (0, 2), 1: (1, 2)}),
    "delete step-2 COMMIT": (["rm step-00000002/COMMIT"], "none", {0: (0, 1), 1: (1, 1)}),
    "garbage step-2 COMMIT": (["garbage step-00000002/COMMIT"], "none",
                              {0: (0, 1), 1: (1, 1)}),
    "delete step-2 rank-00001/": (["rm step-00000002/rank-00001"], "none",
                                  {0: (0, 1), 1: (1, 1)}),
    "delete step-2 rank-00001/ (replicated)": (["rm step-00000002/rank-00001"], "all",
                                               {0: (0, 2), 1: (0, 2)}),
    "truncate step-2 rank-00000 data.bin": (["trunc step-00000002/rank-00000/data.bin"], "none",
                                            {0: (0, 1), 1: (1, 1)}),
    "flip step-2 rank-00001 manifest": (["flip step-00000002/rank-00001/manifest.json"], "none",
                                        {0: (0, 1), 1: (1, 1)}),
    "delete both COMMITs": (["rm step-00000002/COMMIT", "rm step-00000001/COMMIT"], "none",
                            {0: None, 1: None}),
}


def _damage(d: Path, ops: list[str]) -> None:
    for op in ops:
        kind, rel = op.split(" ", 1)
        p = d / rel
        if kind == "rm":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        elif kind == "garbage":
            p.write_bytes(b"\x00not json")
        elif kind == "trunc":
            os.truncate(p, p.stat().st_size // 2)
        elif kind == "flip":
            L.flip_byte(p, p.stat().st_size // 3, 0x04)


def dist_cases(ctx: Ctx, timeout: float = 240.0) -> list[Case]:
    layout = build_dist_layout(ctx)
    plan = []
    for name, (ops, replicas, _) in DIST_CASES.items():
        d = ctx.dir("dcase")
        shutil.copytree(layout, d)
        for p in d.glob(".lock*"):
            p.unlink()
        _damage(d, ops)
        plan.append({"name": name, "dir": str(d), "job": ctx.job("dr"), "replicas": replicas})
    spec = ctx.root / f"dist-plan-{next(ctx._n)}.json"
    spec.write_text(json.dumps(plan))
    init = ctx.root / f"dist-init-{next(ctx._n)}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDASNAP_HEALTH": "0"}
    env.pop("CUDASNAP_JOB", None)
    procs = [subprocess.Popen([sys.executable, __file__, "dist-rank", str(r), str(init), str(spec),
                               str(ctx.shm)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results: dict[int, dict] = {}
    errs = []
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        last = [x for x in so.splitlines() if x.startswith("{")]
        if p.returncode != 0 or not last:
            errs.append(f"rank {r} exited {p.returncode}: {se[-1500:]}")
            continue
        results[r] = json.loads(last[-1])
    out = []
    for item in plan:
        name = item["name"]
        want = DIST_CASES[name][2]
        exp_step = want[0][1] if want[0] else None
        case = Case("dist", name, exp_step)
        if errs:
            case.error = "; ".join(errs)
            out.append(case)
            continue
        gots = [results[r][name] for r in (0, 1)]
        got_steps = {g["step"] for g in gots}
        case.got = min((s for s in got_steps if s is not None), default=None) \
            if None not in got_steps else None
        for r, g in zip((0, 1), gots):
            if g.get("error"):
                case.error += f" rank {r}: {g['error']}"
            who = tuple(g["who"]) if g["who"] else None
            if want[r] is not None and who != want[r]:
                case.torn = True
                case.detail += f" rank {r} holds {who}, want {want[r]};"
            if len(got_steps) != 1:
                case.torn = True
                case.detail += f" ranks disagree: {got_steps};"
        out.append(case)
    return out


def _dist_rank_main(rank: int, init: str, spec: str, shm: str) -> None:
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    res: dict[str, Any] = {}
    for item in json.loads(Path(spec).read_text()):
        m = torch.nn.Linear(DIST_DIM, DIST_DIM)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(-1.0)
        rec: dict[str, Any] = {"step": None, "who": None}
        try:
            snap = Snapshotter(m, None, directory=item["dir"], job=item["job"], rank=rank,
                               world_size=2, distributed=True, replicas=item["replicas"],
                               chunk_bytes=CHUNK, copy_threads=1, shm_dir=shm)
            try:
                start = snap.restore_latest()
            finally:
                snap.close()
            rec["step"] = start - 1 if start else None
            rec["who"] = _who(m) if start else None
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
        res[item["name"]] = rec
        dist.barrier()
    print(json.dumps(res), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------- the matrix

# ---------------------------------------------------------- family: export

EXPORT_DIM = 1800  # ~39 MB of model + AdamW state: a write long enough to be hit


def export_cases(ctx: Ctx, n: int = 4, seed: int = 5) -> list[Case]:
    """SIGKILL ``cudasnap export`` (a real one, no stub) at a random moment of its run, over
    an earlier export of another step (torch, safetensors) or into a fresh target (dcp): the
    target must hold a whole export afterwards, the earlier one or the new one, never a torn
    file or a partial DCP directory (issue 23 item 4: it was torn 3 of 3 times)."""
    from safetensors.torch import load_file

    rng = random.Random(seed)
    d = ctx.dir("export")
    j = Job(dim=EXPORT_DIM)
    snap = Snapshotter(j.model, j.opt, directory=d, job=ctx.job("x"), keep=0, shm_dir=ctx.shm)
    try:  # two steps on disk (boundaries before the arena is ready may be skipped)
        for k in range(50):
            j.step()
            snap.boundary(k)
            snap.wait()
            snap.flush()
            if len(posix.list_snapshots(d)) >= 2:
                break
            time.sleep(0.05)
    finally:
        snap.close()
    s0, s1 = sorted(s.step for s in posix.list_snapshots(d))[-2:]
    out: list[Case] = []
    cmd = [sys.executable, "-m", "cudasnap", "export", str(d)]

    def whole(fmt: str, target: Path) -> int | None:
        """The step of the whole export at ``target`` (None: no export there)."""
        if fmt == "torch":
            return int(torch.load(target, weights_only=True)["step"]) if target.exists() else None
        if fmt == "safetensors":
            if not target.exists():
                return None
            from safetensors import safe_open

            load_file(str(target))  # every tensor reads back
            with safe_open(str(target), "pt") as f:
                return int(f.metadata()["cudasnap_step"])
        if not target.exists():
            return None
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader(str(target)).read_metadata()
        return int(json.loads((target / "cudasnap_host.json").read_text())["step"])

    for fmt in ("torch", "safetensors", "dcp"):
        ext = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ""}[fmt]
        base = ctx.dir(f"export-{fmt}")
        base.mkdir(parents=True)
        t0 = time.perf_counter()
        first = base / f"first{ext}"
        subprocess.run(cmd + ["--to", fmt, "--step", str(s0), str(first)], check=True,
                       capture_output=True, timeout=600)
        took = time.perf_counter() - t0
        for i in range(n):
            case = Case("export", f"{fmt} kill {i}", s0 if fmt != "dcp" else None)

            def one(fmt: str = fmt, case: Case = case, i: int = i, base: Path = base,
                    took: float = took, ext: str = ext) -> Case:
                target = base / (f"t{i}{ext}" if fmt == "dcp" else f"first{ext}")
                if fmt != "dcp":  # start each case from the step-0 export
                    shutil.copyfile(base / f"first{ext}", base / f"keep{ext}")
                    os.replace(base / f"keep{ext}", target)
                delay = rng.uniform(0.3, 1.1) * took
                p = subprocess.Popen(cmd + ["--to", fmt, "--step", str(s1), str(target)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    p.wait(delay)
                except subprocess.TimeoutExpired:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                case.detail = f"killed at {delay:.2f} s of {took:.2f} s (rc {p.returncode})"
                try:
                    case.got = whole(fmt, target)
                except Exception as e:  # noqa: BLE001 - a torn export is the failure here
                    case.torn = True
                    case.detail += f"; unreadable: {type(e).__name__}: {e}"
                    return case
                if fmt == "dcp":  # nothing, or the whole newer export
                    case.expected = case.got
                    case.torn = case.got not in (None, s1)
                else:  # the older export, or the whole newer one
                    case.expected = case.got if case.got in (s0, s1) else s0
                return case
            out.append(guarded(case, one))
    return out


def run_matrix(ctx: Ctx, *, seed: int = 1, n_trunc: int = 60, n_flip: int = 40, n_shm: int = 24,
               families: tuple[str, ...] = ("disk", "shm", "kill", "diskfull", "shmfull", "lock",
                                            "dist"),
               progress: Callable[[str], Any] = lambda s: None) -> list[Case]:
    cases: list[Case] = []
    if "disk" in families:
        base = build_base(ctx)
        cases += disk_cases(ctx, base, n_trunc, n_flip, seed)
        progress(f"disk: {len(cases)} cases")
    if "shm" in families:
        sbase = build_base(ctx, flush_steps=(0,), keep_arena=True)
        cases += shm_cases(ctx, sbase, n_shm, seed + 1)
        progress("shm done")
    if "kill" in families:
        z = Zygote()
        try:
            cases += kill_cases(ctx, z)
        finally:
            z.close()
        progress("kill done")
    if "diskfull" in families:
        cases += diskfull_cases(ctx)
    if "shmfull" in families:
        cases += shmfull_cases(ctx)
    if "lock" in families:
        cases += lock_cases(ctx)
    if "dist" in families:
        cases += dist_cases(ctx)
        progress("dist done")
    if "export" in families:
        cases += export_cases(ctx)
        progress("export done")
    return cases


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "dist-rank":
    _dist_rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
