"""cudasnap on a GPU: D2H bandwidth, training overhead, boundary() cost, flush (one short run).

Four sections, each measured against a baseline taken in the same run on the same bytes:

(a) D2H bandwidth for 256 MiB, 1 GiB and 4 GiB. Ceiling: pinned ``cudaMemcpyAsync``
    (CuPy's runtime call on torch's pointers when CuPy imports, else torch's
    ``copy_(non_blocking=True)``) into cudaHostAlloc'd memory, and into a
    cudaHostRegister'ed /dev/shm mapping (what cudasnap stages into). cudasnap:
    a params + AdamW state of the same size; bytes / (boundary() -> COMPLETE)
    (``stats()['last_copy_gbps']``), the DMA part alone (CUDA events: compute
    stream before boundary() -> copy stream after it), and the host wall time.
    Target: COMPLETE GB/s >= 0.9 x pinned ceiling.
(b) Steady-state overhead: a GPT-2-small-sized model (12 layers, d=768, 12 heads,
    seq 1024), bf16 autocast, AdamW; iteration time without and with
    ``boundary()`` every step, in interleaved A/B blocks (each block starts with
    one untimed step so the copy pipeline is in its steady state). Target:
    median ratio <= 1.01.
(c) ``boundary()`` host time with 1,000 state tensors, copy plan cached
    (``wait()`` between boundaries, untimed). Target: median < 50 us.
(d) ``flush()`` GB/s to a local disk vs a raw ``os.write`` + fsync of the same
    staged bytes (and cudasnap's own multi-threaded pwrite writer).

Prints a short table LAST; with $OUT (or --out) set writes gpu_results.json and
gpu_results.txt there (rewritten after every section, so a killed run leaves
what it measured). A watchdog (--budget, default 420 s) stops the run, prints
the partial table and exits 3. Without a CUDA device it prints
"skipped: no CUDA device" and exits 0. Exit 1: a section failed.

--emulated: a smoke run under the emulated CUDA runtime (tools/cudaemu/run.sh),
which has no kernels and no cuBLAS: tiny sizes, state written by host-to-device
copies, (b) times a copy-and-AdamW step instead of the GPT. The figures are
not GPU figures and no target is judged (the device being the emulator turns
this mode on by itself). --preflight: one small Snapshotter on the device
(bench/gpu_check.sh's preflight): the arena is awaited, one snapshot must
complete, flush and restore bit for bit; prints the facts of this machine
(register ok or the fallback reason, /dev/shm, MADV_POPULATE_WRITE, versions)
as "fact <name>: <value>" lines; exit 0 when it proved all of that, 1 if not.

    python bench/gpu_bench.py [--budget 420] [--quick] [--sections a,b,c,d] [--out DIR]
    python bench/gpu_bench.py --emulated ...   (under tools/cudaemu/run.sh)
    python bench/gpu_bench.py --emulated --timing h200 [--quick] [--json]   (bench/modelled.py)
    python bench/gpu_bench.py --preflight [--preflight-device cuda|cpu]
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import mmap
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (stdlib only at import; puts the repo root on sys.path)

MiB = 1 << 20
GiB = 1 << 30
SKIP_MSG = "skipped: no CUDA device"
TARGETS = {"d2h_ratio": 0.85, "boundary_us": 50.0}
# (b): the step-time ratio each mode of B_MODES must hold (issue 34; the direct copy every
# step is the control: 1.49 GB over a 55 GB/s link outlasts the forward/backward)
B_TARGETS = {"every step, device staging": 1.05, "1% budget, device staging": 1.015}
EMULATED_NOTE = ("EMULATED (tools/cudaemu on the CPU, no GPU): a smoke run of this script; "
                 "these are NOT GPU figures and no target is judged")
# Set by main() for --emulated: device tensors are written by host-to-device copies
# (the emulator runs no kernels) and no verdict is given.
EMULATED = False


def judge(ok: bool) -> bool | None:
    """A target verdict, or None under the emulator (it never decides a GPU claim)."""
    return None if EMULATED else ok


class BudgetExceeded(BaseException):
    """Raised in the main thread by the watchdog (SIGALRM); not an Exception on purpose."""


# ------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=420.0,
                   help="watchdog: wall seconds before the run stops and prints partial results "
                        "(default 420; the whole run must stay under 8 minutes)")
    p.add_argument("--sections", default="a,b,c,d", help="subset of a,b,c,d (default all)")
    p.add_argument("--sizes-mib", default="256,1024,4096",
                   help="(a) sizes in MiB (default 256,1024,4096)")
    p.add_argument("--repeats", type=int, default=5, help="(a) repeats per size (median)")
    p.add_argument("--gpt-batches", default="32,8",
                   help="(b) batch sizes, seq 1024 (default 32,8: a comfortable and a short step)")
    p.add_argument("--pairs", type=int, default=8, help="(b) A/B block pairs (default 8)")
    p.add_argument("--block", type=int, default=10, help="(b) timed steps per block (default 10)")
    p.add_argument("--boundaries", type=int, default=300,
                   help="(c) timed boundary() calls per case (default 300)")
    p.add_argument("--flush-mib", type=int, default=2048, help="(d) state size in MiB (default 2048)")
    p.add_argument("--flush-repeats", type=int, default=3, help="(d) repeats (default 3)")
    p.add_argument("--tmp", default=None,
                   help="(d) directory on a real disk for flushes (default $TMPDIR or /var/tmp; "
                        "refused if tmpfs)")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="directory for gpu_results.json/.txt (default $OUT; none when unset)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: small sizes, few repeats, one small GPT batch (~1 min)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check this script's own logic on the CPU backend, tiny sizes, no GPU "
                        "needed (the numbers mean nothing; CUDA-only columns stay empty)")
    p.add_argument("--emulated", action="store_true",
                   help="smoke run under the emulated CUDA runtime (tools/cudaemu): tiny sizes, "
                        "state changed by copies, no kernels; not GPU figures, no verdicts")
    p.add_argument("--timing", default=None, metavar="PROFILE",
                   help="with --emulated: the emulator's timing model (h200, h100) instead of "
                        "the smoke run: (a) and (b) as ratios against the model's ideal "
                        "(bench/modelled.py); never GPU figures")
    p.add_argument("--json", action="store_true",
                   help="with --timing: print only the result's JSON object (last line)")
    p.add_argument("--preflight", action="store_true",
                   help="run the preflight only (see below) and exit")
    p.add_argument("--preflight-device", default="cuda", choices=["cuda", "cpu"],
                   help="device of the preflight's model (default cuda)")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    for s in a.sections:
        if s not in ("a", "b", "c", "d"):
            p.error(f"unknown section {s!r}; expected a subset of a,b,c,d")
    try:
        a.sizes = [int(x) * MiB for x in a.sizes_mib.split(",") if x.strip()]
        a.batches = [int(x) for x in a.gpt_batches.split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    if a.quick:
        a.sizes, a.repeats = [64 * MiB, 256 * MiB], min(a.repeats, 3)
        a.batches, a.pairs, a.block = [4], min(a.pairs, 3), min(a.block, 4)
        a.boundaries, a.flush_mib, a.flush_repeats = min(a.boundaries, 100), 256, 2
    a.gpt = dict(vocab=50304, d=768, layers=12, heads=12, seq=1024)
    a.c_numel = 16384
    if a.emulated and a.cpu_smoke:
        p.error("--emulated and --cpu-smoke exclude each other")
    if a.timing and not a.emulated:
        p.error("--timing models a GPU on the emulator: it needs --emulated")
    if a.emulated:
        a.sizes, a.repeats = [8 * MiB, 32 * MiB], 2
        a.batches, a.pairs, a.block = [1], 2, 3
        a.boundaries, a.c_numel, a.flush_mib, a.flush_repeats = 30, 1024, 32, 1
    if a.cpu_smoke:
        a.sizes, a.repeats = [4 * MiB], 2
        a.batches, a.pairs, a.block = [2], 2, 2
        a.gpt = dict(vocab=512, d=64, layers=2, heads=4, seq=64)
        a.boundaries, a.c_numel, a.flush_mib, a.flush_repeats = 20, 256, 8, 1
    if a.repeats < 1 or a.pairs < 1 or a.block < 1 or a.boundaries < 1 or a.flush_repeats < 1:
        p.error("repeats, pairs, block, boundaries and flush-repeats must be >= 1")
    if a.budget <= 0:
        p.error("--budget must be > 0")
    return a


# ------------------------------------------------------------------ results
class Results:
    """Everything measured so far; written to --out after every section."""

    def __init__(self, out: str | None, budget: float) -> None:
        self.t0 = time.monotonic()
        self.out = Path(out) if out else None
        self.lock = threading.RLock()
        self.data: dict[str, Any] = {"status": "running", "budget_s": budget, "env": {},
                                     "a": [], "b": [], "c": [], "d": [], "errors": [],
                                     "notes": []}
        self.printed = False

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def add(self, section: str, row: dict[str, Any]) -> None:
        with self.lock:
            self.data[section].append(row)
        self.save()

    def note(self, text: str) -> None:
        print(f"   note: {text}", flush=True)
        with self.lock:
            self.data["notes"].append(text)

    def error(self, section: str, exc: BaseException) -> None:
        tb = traceback.format_exc(limit=6)
        print(f"!! section ({section}) failed: {type(exc).__name__}: {exc}\n{tb}", flush=True)
        with self.lock:
            self.data["errors"].append({"section": section, "error": f"{type(exc).__name__}: {exc}",
                                        "traceback": tb})
        self.save()

    def save(self) -> None:
        if self.out is None:
            return
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                tmp = self.out / "gpu_results.json.tmp"
                tmp.write_text(json.dumps(self.data, indent=1, default=str))
                os.replace(tmp, self.out / "gpu_results.json")
                (self.out / "gpu_results.txt").write_text(table(self.data) + "\n")
            except OSError as e:  # never let a full disk kill the measurement
                print(f"!! cannot write results to {self.out}: {e}", flush=True)

    def summary(self) -> None:
        """Issue 34's keys (bench/results/gpu-YYYY-MM-DD.json): COMPLETE over the pinned
        ceiling at 256 MiB, GPT-2 small's step ratios (device staging every step; the
        default budget), boundary() at 1,000 parameters; None where not measured."""
        d = self.data

        def first(section: str, pick: Callable[[dict[str, Any]], bool], key: str) -> Any:
            return next((r.get(key) for r in d.get(section, []) if pick(r)), None)

        d.update(date=time.strftime("%Y-%m-%d", time.gmtime()),
                 emulated=bool(d["env"].get("emulated")),
                 complete_ratio=first("a", lambda r: r.get("bytes") == 256 * MiB, "ratio"),
                 gpt2_every_step_ratio=first(
                     "b", lambda r: r.get("mode") == "every step, device staging", "ratio"),
                 gpt2_every_step_direct_ratio=first(
                     "b", lambda r: r.get("mode") == "every step", "ratio"),
                 gpt2_budget_ratio=first(
                     "b", lambda r: r.get("mode") == "1% budget, device staging", "ratio"),
                 boundary_us_median=first(
                     "c", lambda r: r.get("label") == "1000 params, no optim", "median_us"))

    def finish(self, status: str) -> None:
        with self.lock:
            if self.printed:
                return
            self.printed = True
            self.summary()
            self.data["status"] = status
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            self.save()
            print("\n" + table(self.data), flush=True)


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def table(d: dict[str, Any]) -> str:
    env = d.get("env", {})
    L = [f"== cudasnap GPU bench: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
         f"CUDA {env.get('cuda', '?')}, driver {env.get('driver', '?')}, "
         f"copy via {env.get('copy_api', '?')} =="]
    if env.get("emulated"):
        L.append(f"!! {EMULATED_NOTE}")
    if d["a"]:
        L.append("(a) D2H GB/s, median        pinned  shm-reg  snap-DMA  snap-COMPLETE  "
                 "host-wall  ratio  target")
        for r in d["a"]:
            L.append(f"    {r['label']:<24}{_f(r.get('ceiling_pinned_gbps')):>7}"
                     f"{_f(r.get('ceiling_shm_gbps')):>9}{_f(r.get('snap_dma_gbps')):>10}"
                     f"{_f(r.get('snap_complete_gbps')):>15}{_f(r.get('snap_wall_gbps')):>11}"
                     f"{_f(r.get('ratio')):>7}  >={TARGETS['d2h_ratio']:.2f} "
                     f"{_verdict(r.get('ok'))}")
    if d["b"]:
        what = "copy+AdamW step (emu)" if env.get("emulated") else "GPT-2 small bf16 AdamW"
        L.append(f"(b) {what:<25}base ms  snap ms  ratio  [min..max]     "
                 "stall/step ms  target")
        for r in d["b"]:
            t = r.get("target_ratio")
            L.append(f"    {r['label']:<24}{_f(r.get('base_ms')):>8}{_f(r.get('snap_ms')):>9}"
                     f"{_f(r.get('ratio'), '{:.3f}'):>7}  [{_f(r.get('ratio_min'), '{:.3f}')}.."
                     f"{_f(r.get('ratio_max'), '{:.3f}')}]{_f(r.get('fence_wait_ms_per_step')):>11}"
                     f"     {'<=' + format(t, '.3f') if t else 'control'} {_verdict(r.get('ok'))}")
    if d["c"]:
        L.append("(c) boundary() host time     median us  p90 us  rebuilds  tensors  ranges  target")
        for r in d["c"]:
            L.append(f"    {r['label']:<24}{_f(r.get('median_us'), '{:.1f}'):>10}"
                     f"{_f(r.get('p90_us'), '{:.1f}'):>8}{r.get('layout_rebuilds', '-'):>10}"
                     f"{r.get('tensors', '-'):>9}{r.get('ranges', '-'):>8}"
                     f"  <{TARGETS['boundary_us']:.0f} {_verdict(r.get('ok'))}")
    if d["d"]:
        L.append("(d) flush to disk GB/s       flush  raw write+fsync  raw native  "
                 "flush/raw  disk")
        for r in d["d"]:
            L.append(f"    {r['label']:<24}{_f(r.get('flush_gbps')):>6}"
                     f"{_f(r.get('raw_os_gbps')):>17}{_f(r.get('raw_native_gbps')):>12}"
                     f"{_f(r.get('ratio')):>11}  {r.get('fs', '?')}")
    for e in d.get("errors", []):
        L.append(f"ERROR ({e['section']}): {e['error']}")
    L.append(f"status: {d.get('status')} after {_f(d.get('elapsed_s'), '{:.0f}')} s "
             f"(budget {d.get('budget_s'):.0f} s)")
    return "\n".join(L)


# ------------------------------------------------------------------ watchdog
def _inside_import(frame: Any) -> bool:
    """True when the interrupted code runs under the import machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_WATCH = {"caught": False}


def watchdog_caught() -> None:
    """main() calls this first when BudgetExceeded reached it: stops the re-raising."""
    _WATCH["caught"] = True
    signal.setitimer(signal.ITIMER_REAL, 0)


def install_watchdog(res: Results, budget: float) -> None:
    """SIGALRM at ``budget`` s raises BudgetExceeded in the main thread; a thread kills the
    process 30 s later if the main thread is stuck in C code (printing the partial table).

    The raise can be swallowed: an alarm that lands in a weakref callback or a ``__del__``
    becomes an "Exception ignored in" line and the loop goes on (CI saw a 100-million
    boundary run end "complete" that way). So the alarm re-arms itself every second until
    main() calls watchdog_caught(), and an unraisable BudgetExceeded re-arms it at once."""
    _WATCH["caught"] = False

    def on_alarm(signum: int, frame: Any) -> None:
        if _WATCH["caught"]:
            return
        if _inside_import(frame):
            # An exception raised while a C extension initialises (torch's import runs
            # pybind11 code that cannot carry one) aborts the process; retry shortly.
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            return
        signal.setitimer(signal.ITIMER_REAL, 1.0)  # again, in case this one is swallowed
        raise BudgetExceeded(f"watchdog: budget of {budget:.0f} s exceeded")

    previous_hook = sys.unraisablehook

    def on_unraisable(u: Any) -> None:
        if isinstance(u.exc_value, BudgetExceeded) and not _WATCH["caught"]:
            print(f"!! watchdog: the alarm landed in {u.object!r}, which drops exceptions;"
                  " raising it again", file=sys.stderr, flush=True)
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        previous_hook(u)

    sys.unraisablehook = on_unraisable
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(budget)))

    def hard() -> None:
        time.sleep(budget + 30)
        print(f"!! watchdog: still running {budget + 30:.0f} s in; exiting hard", flush=True)
        res.note("hard watchdog: the main thread did not return after SIGALRM")
        res.finish("PARTIAL (hard watchdog)")
        os._exit(3)

    threading.Thread(target=hard, name="gpu-bench-watchdog", daemon=True).start()


# ------------------------------------------------------------------ helpers
def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def release_gpu() -> None:
    import torch

    gc.collect()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        C.free_mem()
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks torch caches
    if host_empty is not None:
        host_empty()
    C.free_mem()


def fill_random(t: Any, seed: int) -> None:
    """Non-zero, non-constant bytes (never time zeros)."""
    import torch

    if EMULATED and t.is_cuda:  # no kernels under the emulator: fill on the host, copy
        host = torch.empty(t.shape, dtype=t.dtype)
        fill_random(host, seed)
        t.copy_(host)
        return
    g = torch.Generator(device=t.device).manual_seed(seed)
    flat = t.view(-1)
    if flat.dtype.is_floating_point:
        flat.normal_(generator=g)
    else:
        flat.random_(0, 255, generator=g)


def snapshotter(model: Any, opt: Any, tmp: Path, tag: str, ready: bool = True,
                **kw: Any) -> Any:
    """With ``ready``: returns once the staging arena (made in the background) is usable,
    so no measured boundary is one skipped for want of an arena."""
    import cudasnap

    d = tmp / f"ckpt-{tag}"
    if "overhead_budget" in inspect.signature(cudasnap.Snapshotter).parameters:
        kw.setdefault("overhead_budget", 0.0)  # every boundary copies unless a row says so
    s = cudasnap.Snapshotter(model, opt, directory=d, job=f"gpubench-{os.getpid()}-{tag}",
                             health=False, **kw)
    if ready:
        s.arena_ready(300)
    return s


def adam_state(total_bytes: int, n_params: int, device: Any, seed: int = 0) -> tuple[Any, Any]:
    """float32 params + AdamW moments totalling ``total_bytes`` (3 x parameter bytes)."""
    import torch

    numel = max(1024, total_bytes // 12 // n_params)
    params = [torch.nn.Parameter(torch.empty(numel, device=device)) for _ in range(n_params)]
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i, p in enumerate(params):
        fill_random(p.data, seed + i)
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq (and the host 'step')
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for i, st in enumerate(opt.state.values()):
            fill_random(st["exp_avg"], seed + 1000 + i)
            fill_random(st["exp_avg_sq"], seed + 2000 + i)
    sync()
    return model, opt


def check_shm(need: int, what: str, res: Results) -> bool:
    free = C.shm_free()
    if free < need + 256 * MiB:
        res.note(f"{what}: needs {need / GiB:.1f} GiB of /dev/shm, {free / GiB:.1f} GiB free: skipped")
        return False
    return True


# ------------------------------------------------------------------ copy API
class D2H:
    """Device-to-host async copy on one stream: CuPy's cudaMemcpyAsync or torch copy_."""

    def __init__(self, device: int) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.cp = None
        self.api = "torch copy_(non_blocking)"
        if os.environ.get("CUDASNAP_BENCH_NO_CUPY") != "1":
            try:
                import cupy

                cupy.cuda.Device(device).use()
                self.cp = cupy
                # one tiny copy proves the call works with torch's pointers/stream
                a = torch.arange(1024, dtype=torch.uint8, device=f"cuda:{device}")
                h = torch.empty(1024, dtype=torch.uint8, pin_memory=True)
                self.stream.wait_stream(torch.cuda.current_stream())
                self._cupy(h.data_ptr(), a.data_ptr(), 1024)
                self.stream.synchronize()
                if not torch.equal(h, a.cpu()):
                    raise RuntimeError("CuPy memcpyAsync copied wrong bytes")
                self.api = f"CuPy {cupy.__version__} cudaMemcpyAsync"
            except Exception as e:  # noqa: BLE001 - any CuPy trouble: use torch
                self.cp = None
                self.api = f"torch copy_(non_blocking) (CuPy unusable: {type(e).__name__})"

    def _cupy(self, dst: int, src: int, n: int) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst, src, n, rt.memcpyDeviceToHost, self.stream.cuda_stream)

    def time_copy(self, dst: Any, src: Any, n: int) -> float:
        """Seconds of one n-byte D2H copy (CUDA events on the copy stream)."""
        torch = self.torch
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            e0.record(self.stream)
            if self.cp is not None:
                self._cupy(dst.data_ptr(), src.data_ptr(), n)
            else:
                dst[:n].copy_(src[:n], non_blocking=True)
            e1.record(self.stream)
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3


class ShmRegistered:
    """A /dev/shm mapping, pre-faulted and cudaHostRegister'ed (cudasnap's staging kind)."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.torch = torch
        self.file = Path("/dev/shm") / f"cudasnap-gpubench-{os.getpid()}.ceiling"
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.tensor.fill_(1)  # pre-fault every page
        self.registered = False
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
        code = getattr(err, "value", err)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: error {err}")
        self.registered = True

    def close(self) -> None:
        if self.registered:
            self.torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        del self.tensor
        gc.collect()
        try:
            self.mm.close()
        except BufferError:
            pass
        self.file.unlink(missing_ok=True)


def _label(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB and n % GiB == 0 else f"{n // MiB} MiB"


# ------------------------------------------------------------------ (a)
def target_device(a: argparse.Namespace) -> Any:
    import torch

    return torch.device("cpu") if a.cpu_smoke else torch.device("cuda", a.device)


def ceilings(a: argparse.Namespace, res: Results, d2h: D2H, n: int, row: dict[str, Any]) -> None:
    """Pinned cudaMemcpyAsync D2H GB/s into cudaHostAlloc'd and into registered shm memory."""
    import torch

    src = torch.empty(n, dtype=torch.uint8, device=target_device(a))
    fill_random(src, 7)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2h.time_copy(pinned, src, n)  # warm-up
    ts = [d2h.time_copy(pinned, src, n) for _ in range(a.repeats)]
    row["ceiling_pinned_gbps"] = n / median(ts) / 1e9
    row["ceiling_pinned_all"] = [round(n / t / 1e9, 2) for t in ts]
    if not torch.equal(pinned[:4096], src[:4096].cpu()):
        raise RuntimeError("ceiling copy produced wrong bytes")
    del pinned
    release_gpu()
    if not check_shm(n, f"(a) {row['label']} shm ceiling", res):
        return
    shm = None
    try:
        shm = ShmRegistered(n)
        d2h.time_copy(shm.tensor, src, n)
        ts = [d2h.time_copy(shm.tensor, src, n) for _ in range(a.repeats)]
        row["ceiling_shm_gbps"] = n / median(ts) / 1e9
    except Exception as e:  # noqa: BLE001
        res.note(f"(a) {row['label']}: shm-registered ceiling failed: {e}")
    finally:
        if shm is not None:
            shm.close()


def snapshot_bandwidth(a: argparse.Namespace, res: Results, tmp: Path, n: int,
                       row: dict[str, Any]) -> None:
    """cudasnap on a params + AdamW state of n bytes: boundary() -> COMPLETE GB/s."""
    import torch

    dev = target_device(a)
    model, opt = adam_state(n, 8, dev, seed=11)
    snap = snapshotter(model, opt, tmp, f"a{n}", ready=False)
    try:
        t0 = time.perf_counter()
        snap.arena_ready(300)  # arena pre-faulted + cudaHostRegister'ed off the training thread
        row["arena_ready_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        snap.boundary(0)  # builds the plan; adopts the prepared arena
        if not snap.wait(timeout=300):
            raise RuntimeError("first snapshot did not complete in 300 s")
        row["first_boundary_s"] = time.perf_counter() - t0
        row["arena_setup_s"] = snap.stats()["arena_setup_seconds"]
        copy_stream = None
        if dev.type == "cuda":
            try:
                copy_stream = torch.cuda.ExternalStream(snap.copy_stream_handle(),
                                                        device=dev)
            except Exception as e:  # noqa: BLE001
                res.note(f"(a) no copy-stream handle, DMA column empty: {e}")
        cg: list[float] = []
        dma: list[float] = []
        wall: list[float] = []
        params = list(model.parameters())
        for r in range(1, a.repeats + 2):
            opt.step()  # no grads: only the fence hook runs (as in training)
            if EMULATED:  # new bytes in one tensor each time: a host-to-device copy
                fill_random(params[r % len(params)].data, 100 + r)
            sync()
            e0 = e1 = None
            if copy_stream is not None:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            snap.boundary(r)
            if e1 is not None:
                e1.record(copy_stream)
            if not snap.wait(timeout=120):
                raise RuntimeError(f"snapshot {r} did not complete in 120 s")
            t1 = time.perf_counter()
            st = snap.stats()
            if r == 1:
                continue  # warm-up (the second slot's first use)
            cg.append(st["last_copy_gbps"] or 0.0)
            wall.append(st["bytes"] / (t1 - t0) / 1e9)
            if e0 is not None and e1 is not None:
                e1.synchronize()
                dma.append(st["bytes"] / (e0.elapsed_time(e1) / 1e3) / 1e9)
        st = snap.stats()
        row.update(snap_bytes=st["bytes"], snap_complete_gbps=median(cg),
                   snap_complete_all=[round(x, 2) for x in cg],
                   snap_dma_gbps=median(dma), snap_wall_gbps=median(wall),
                   boundary_us_median=st["boundary_us_median"],
                   backend=st["backend"], skipped=st["skipped"],
                   copy_ranges=st["layout"]["copy_ranges"])
        if st["backend"] == "cuda":
            row["private_arena_reason"] = st["staging"]["fallback_reason"]
            row["tracking"] = st["layout"]["allocator_tracking"]
    finally:
        snap.close()


def section_a(a: argparse.Namespace, res: Results, tmp: Path, d2h: D2H | None) -> None:
    for n in a.sizes:
        row: dict[str, Any] = {"label": _label(n), "bytes": n}
        print(f"-- (a) {row['label']}", flush=True)
        if d2h is not None:
            ceilings(a, res, d2h, n, row)
            release_gpu()
        if check_shm(int(2.1 * n), f"(a) {row['label']} cudasnap arena (2 slots)", res):
            snapshot_bandwidth(a, res, tmp, n, row)
            release_gpu()
        if row.get("ceiling_pinned_gbps") and row.get("snap_complete_gbps"):
            row["ratio"] = row["snap_complete_gbps"] / row["ceiling_pinned_gbps"]
            row["ok"] = judge(row["ratio"] >= TARGETS["d2h_ratio"])
        res.add("a", row)
        shown = {k: v for k, v in row.items() if not k.endswith("_all")}
        print(f"   {json.dumps(shown, default=str)}", flush=True)


# ------------------------------------------------------------------ (b)
def gpt2_small(vocab: int = 50304, d: int = 768, layers: int = 12, heads: int = 12,
               seq: int = 1024) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            B, T, Cd = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, heads, Cd // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, Cd))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied, as in GPT-2

        def forward(self, idx: Any) -> Any:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x))

    return GPT()


# (b)'s modes: the Snapshotter's keywords (issue 34: every step copied straight to the
# host, every step through a device staging buffer, the default 1% overhead budget).
B_MODES: dict[str, dict[str, Any]] = {
    "every step": {"overhead_budget": 0.0},
    "every step, device staging": {"overhead_budget": 0.0, "device_staging": "auto"},
    "1% budget, device staging": {"overhead_budget": 0.01, "device_staging": "auto"},
}


def overhead(a: argparse.Namespace, tmp: Path, batch: int, row: dict[str, Any],
             mode: str = "every step") -> None:
    """Iteration time without / with boundary() at every step, interleaved A/B blocks;
    the Snapshotter of ``mode`` (B_MODES) decides which boundaries copy and how."""
    import torch
    import torch.nn.functional as F

    dev = target_device(a)
    vocab, seq = a.gpt["vocab"], a.gpt["seq"]
    torch.manual_seed(0)
    if EMULATED:
        model, opt, step = copy_step(a, dev)
    else:
        model = gpt2_small(**a.gpt).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        x = torch.randint(0, vocab, (batch, seq), device=dev)
        y = torch.randint(0, vocab, (batch, seq), device=dev)

        def step() -> None:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    row["params"] = sum(p.numel() for p in model.parameters())

    for _ in range(5):
        step()  # warm-up: kernels, AdamW state
    snap = snapshotter(model, opt, tmp, f"b{batch}{len(row)}", **B_MODES[mode])
    row["mode"] = mode
    try:
        k = 0
        # arena + plan + both slots warm (the budget: its first measurements too)
        for _ in range(24 if "budget" in mode else 3):
            step()
            snap.boundary(k)
            k += 1
        snap.wait(timeout=120)
        st0 = snap.stats()
        row["state_bytes"] = st0["bytes"]

        def block(with_snap: bool, k: int) -> tuple[float, int]:
            step()  # untimed lead-in: the pipeline (copy of the previous step) is steady
            if with_snap:
                snap.boundary(k)
                k += 1
            sync()
            t0 = time.perf_counter()
            for _ in range(a.block):
                step()
                if with_snap:
                    snap.boundary(k)
                    k += 1
            sync()
            dt = (time.perf_counter() - t0) / a.block
            if with_snap:
                snap.wait(timeout=120)  # untimed: the next block starts clean
            return dt, k

        base_t: list[float] = []
        snap_t: list[float] = []
        ratios: list[float] = []
        for i in range(a.pairs):
            got = {}
            for with_snap in ((False, True) if i % 2 == 0 else (True, False)):
                got[with_snap], k = block(with_snap, k)
            base_t.append(got[False])
            snap_t.append(got[True])
            ratios.append(got[True] / got[False])
        st = snap.stats()
        n_snaps = st["snapshots"] - st0["snapshots"]
        row.update(base_ms=median(base_t) * 1e3, snap_ms=median(snap_t) * 1e3,
                   ratio=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                   ratios=[round(r, 4) for r in ratios],
                   base_spread_pct=(max(base_t) - min(base_t)) / median(base_t) * 100,
                   snapshots=n_snaps, skipped=st["skipped"],
                   fence_wait_ms_per_step=(st["fence_wait_s"] - st0["fence_wait_s"]) * 1e3
                   / max(1, n_snaps),
                   last_copy_gbps=st["last_copy_gbps"],
                   last_copy_ms=(st["last_copy_seconds"] or 0) * 1e3,
                   boundary_us_median=st["boundary_us_median"],
                   cadence=st.get("cadence"),
                   device_staging_bytes=st.get("device_staging_bytes"),
                   peak_gpu_gib=(torch.cuda.max_memory_allocated(dev) / GiB
                                 if dev.type == "cuda" else None))
        target = B_TARGETS.get(mode)
        row["target_ratio"] = target
        row["ok"] = judge(row["ratio"] <= target) if target is not None else None
    finally:
        snap.close()


def copy_step(a: argparse.Namespace, dev: Any) -> tuple[Any, Any, Callable[[], None]]:
    """(b) under the emulator (no kernels, no cuBLAS): 8 parameters + AdamW; a step sets
    the gradients, runs AdamW (its kernels are no-ops there: the fence hooks still run)
    and writes new bytes into one parameter with a host-to-device copy."""
    import torch

    params = [torch.nn.Parameter(torch.empty(a.c_numel * 64, device=dev)) for _ in range(8)]
    for i, p in enumerate(params):
        fill_random(p.data, 300 + i)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    grads = [torch.empty_like(p) for p in params]
    for i, g in enumerate(grads):
        fill_random(g, 400 + i)
    src = [torch.randn(p.shape) for p in params[:2]]
    k = [0]

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        k[0] += 1
        params[k[0] % 2].data.copy_(src[k[0] % 2])

    return model, opt, step


def section_b(a: argparse.Namespace, res: Results, tmp: Path) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    on_gpu = not a.cpu_smoke
    for batch, mode in [(b, m) for b in a.batches for m in B_MODES]:
        label = "copy step (emulated)" if EMULATED else f"batch {batch} x {a.gpt['seq']}"
        row: dict[str, Any] = {"label": f"{label}, {mode}"}
        print(f"-- (b) {row['label']}", flush=True)
        try:
            overhead(a, tmp, batch, row, mode)
        except torch.cuda.OutOfMemoryError as e:
            res.note(f"(b) {row['label']}: out of GPU memory ({e}); skipped")
            row["error"] = "OOM"
        release_gpu()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(target_device(a))
        res.add("b", row)
        shown = {k: v for k, v in row.items() if k != "ratios"}
        print(f"   {json.dumps(shown, default=str)}", flush=True)
        if res.elapsed() > a.budget * 0.8:
            res.note("(b) stopping early: 80% of the budget used")
            break


# ------------------------------------------------------------------ (c)
def boundary_cost(a: argparse.Namespace, tmp: Path, n: int, with_opt: bool,
                  row: dict[str, Any], **snap_kw: Any) -> None:
    import torch

    dev = target_device(a)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(a.c_numel, device=dev)) for _ in range(n))
    opt = None
    if with_opt:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    snap = snapshotter(model, opt, tmp, f"c{n}{len(snap_kw)}", **snap_kw)
    try:
        for s in range(5):  # plan built, arena up, both slots used
            snap.boundary(s)
            snap.wait(timeout=60)
        rebuilds0 = snap.stats()["layout_rebuilds"]
        ns = []
        for s in range(5, 5 + a.boundaries):
            snap.wait(timeout=60)  # untimed: no copy in flight
            t0 = time.perf_counter_ns()
            snap.boundary(s)
            ns.append(time.perf_counter_ns() - t0)
        snap.wait(timeout=60)
        ns.sort()
        st = snap.stats()
        row.update(median_us=ns[len(ns) // 2] / 1e3, p90_us=ns[int(len(ns) * 0.9)] / 1e3,
                   min_us=ns[0] / 1e3, calls=len(ns),
                   layout_rebuilds=st["layout_rebuilds"] - rebuilds0,
                   tensors=st["layout"]["tensors"], ranges=st["layout"]["copy_ranges"],
                   skipped=st["skipped"])
        row["ok"] = judge(row["median_us"] < TARGETS["boundary_us"])
    finally:
        snap.close()


def section_c(a: argparse.Namespace, res: Results, tmp: Path) -> None:
    import inspect

    import cudasnap

    cases: list[tuple[str, int, bool, dict[str, Any]]] = [
        ("1000 params, no optim", 1000, False, {}), ("250 params + AdamW", 250, True, {})]
    if "rng_sources" in inspect.signature(cudasnap.Snapshotter).parameters:
        cases.append(("1000 params, torch RNG", 1000, False,
                      {"rng_sources": ("torch", "cuda")}))
    for label, n, with_opt, kw in cases:
        row: dict[str, Any] = {"label": label, **({"snapshotter_kw": kw} if kw else {})}
        print(f"-- (c) {label}", flush=True)
        boundary_cost(a, tmp, n, with_opt, row, **kw)
        release_gpu()
        res.add("c", row)
        print(f"   {json.dumps(row, default=str)}", flush=True)


# ------------------------------------------------------------------ (d)
def _write_once(kind: str, snap: Any, slot: int, nbytes: int, path: Path) -> float:
    """Seconds for one durable write of the slot's bytes by ``kind``."""
    arena = snap.staged_arenas()[0]
    if kind == "flush":
        t0 = time.perf_counter()
        out = snap.flush(wait=False)
        dt = time.perf_counter() - t0
        if out is None or not snap.stats()["last_flush_seconds"]:
            raise RuntimeError(f"flush wrote nothing ({out})")
        return dt
    if kind == "os":
        return C.raw_write_os(arena.data_view(slot, nbytes), path)
    return C.raw_write_native(arena.data_ptr(slot), nbytes, path, threads=snap.flush_threads)


def flush_bandwidth(a: argparse.Namespace, disk: Path, n: int, row: dict[str, Any]) -> None:
    dev = target_device(a)
    model, opt = adam_state(n, 8, dev, seed=21)
    snap = snapshotter(model, opt, disk, "d", keep=2)
    try:
        got: dict[str, list[float]] = {"flush": [], "os": [], "native": []}
        kinds = list(got)
        nbytes = 0
        for r in range(a.flush_repeats + 1):
            opt.step()
            snap.boundary(r)  # a new step each time: flushing an already flushed slot is a no-op
            if not snap.wait(timeout=120):
                raise RuntimeError("snapshot did not complete")
            arena = snap.staged_arenas()[0]
            slot = arena.newest_complete()
            nbytes = int(arena.slot_info(slot)["data_bytes"])
            order = kinds[r % 3:] + kinds[:r % 3]  # rotate: disk noise hits all alike
            for kind in order:
                dt = _write_once(kind, snap, slot, nbytes, disk / f"raw-{kind}-{r}")
                if r > 0:  # r == 0: warm-up
                    got[kind].append(nbytes / dt / 1e9)
        row.update(bytes=nbytes, flush_gbps=median(got["flush"]), raw_os_gbps=median(got["os"]),
                   raw_native_gbps=median(got["native"]),
                   flush_all=[round(x, 2) for x in got["flush"]],
                   raw_os_all=[round(x, 2) for x in got["os"]], flush_threads=snap.flush_threads)
        row["ratio"] = row["flush_gbps"] / row["raw_os_gbps"]
    finally:
        snap.close()


def section_d(a: argparse.Namespace, res: Results, tmp: Path) -> None:
    n = a.flush_mib * MiB
    if not check_shm(int(2.1 * n), "(d) arena", res):
        return
    disk = C.disk_tmpdir(a.tmp, "gpuflush")
    row: dict[str, Any] = {"label": _label(n), "fs": C.fs_type(disk), "dir": str(disk)}
    print(f"-- (d) {row['label']} to {C.disk_line(disk)}", flush=True)
    try:
        flush_bandwidth(a, disk, n, row)
    finally:
        release_gpu()
        C.rm(disk)
    res.add("d", row)
    print(f"   {json.dumps(row, default=str)}", flush=True)


# ------------------------------------------------------------------ preflight
MADV_POPULATE_WRITE = 23  # Linux 5.14; absent under gVisor and older kernels


def madv_populate_write() -> str:
    """Whether madvise(MADV_POPULATE_WRITE) works on a MAP_SHARED /dev/shm mapping (how
    cudasnap pre-faults its arena; without it pages are touched one by one)."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="cudasnap-preflight-madv-")
    try:
        os.ftruncate(fd, 1 << 16)
        mm = mmap.mmap(fd, 1 << 16)
        try:
            buf = (ctypes.c_char * (1 << 16)).from_buffer(mm)
            rc = libc.madvise(ctypes.addressof(buf), 1 << 16, MADV_POPULATE_WRITE)
            err = ctypes.get_errno()
            del buf
        finally:
            mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    if rc == 0:
        return "available"
    return (f"missing ({errno.errorcode.get(err, err)}): the arena is pre-faulted by touching "
            "each page")


def driver_version(device: int = 0) -> str:
    """nvidia-smi's driver version, else the driver API version (cuDriverGetVersion)."""
    import ctypes
    import subprocess

    try:
        q = subprocess.run(["nvidia-smi", f"--id={device}", "--query-gpu=driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        v = q.stdout.strip().splitlines()[0].strip() if q.returncode == 0 else ""
        if v:
            return v
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(n)) == 0:
            return f"CUDA {n.value // 1000}.{n.value % 1000 // 10} (cuDriverGetVersion; no nvidia-smi)"
    except (OSError, AttributeError):
        pass
    return "?"


def emulator_loaded() -> bool:
    """True under tools/cudaemu (its control API is in the process)."""
    import ctypes

    try:
        ctypes.CDLL(None).cudaemu_fault  # noqa: B018 - a lookup is the test
        return True
    except AttributeError:
        return False


def _as_bytes(t: Any) -> Any:
    return t.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8)


def preflight(device: str = "cuda", timeout: float = 60.0) -> int:
    """bench/gpu_check.sh's preflight: 0 when a snapshot on ``device`` completed, was
    flushed and restores bit for bit (and, on CUDA, its arena is page-locked: shared and
    registered, or a private pinned one whose reason is printed); 1 otherwise.

    Prints what it found as "fact <name>: <value>" lines (the check's table shows them).
    """
    import shutil

    t0 = time.monotonic()

    def fact(k: str, v: Any) -> None:
        print(f"fact {k}: {v}", flush=True)

    du = shutil.disk_usage("/dev/shm")
    small = (" (SMALL: arenas need 2-3x the state; bench sections that do not fit are "
             "skipped)" if du.free < 2 * GiB else "")
    fact("/dev/shm", f"{du.total / GiB:.1f} GiB, {du.free / GiB:.1f} GiB free{small}")
    try:
        fact("MADV_POPULATE_WRITE", madv_populate_write())
    except OSError as e:
        fact("MADV_POPULATE_WRITE", f"unknown ({e})")
    import torch

    import cudasnap

    emulated = device == "cuda" and emulator_loaded()
    if device == "cpu":
        fact("device", "CPU backend (faked detection: no CUDA checked)")
    elif emulated:
        fact("device", "EMULATED (tools/cudaemu): not a GPU")
    else:
        fact("device", "real CUDA device")
    drv = driver_version() if device == "cuda" else "-"
    fact("versions", f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver {drv}, "
                     f"python {sys.version.split()[0]}")
    info = cudasnap.build_info()
    print(f"build_info: backends {info['backends']}, built against torch "
          f"{info['torch_built_against']}, CUDA {info['cuda_version']}, archs "
          f"{info['cuda_architectures']}", flush=True)
    if device == "cuda" and not torch.cuda.is_available():
        print("preflight FAILED: torch sees no CUDA device", flush=True)
        return 1
    dev = torch.device(device)
    # ~2.1 MB of parameters + Adam moments, 3 slots: ~19 MB, over the 16 MiB arenas made at
    # a boundary: the arena is made in the background and must be awaited.
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    d = Path(tempfile.mkdtemp(prefix="cudasnap-preflight-"))
    job = f"preflight-{os.getpid()}"
    snap = cudasnap.Snapshotter(model, opt, directory=d, job=job, health=False, keep=1,
                                backend="cuda" if device == "cuda" else "auto")
    snap2 = None
    try:
        gen = torch.Generator().manual_seed(0)
        params = list(model.parameters())
        for p in params:  # gradients and new values by host-to-device copies (no kernel
            p.grad = torch.randn(p.shape, generator=gen).to(dev)  # is needed for them)
        opt.step()  # makes Adam's moments (under the emulator its kernels are no-ops)
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in params:
                p.copy_(torch.randn(p.shape, generator=gen))
        want_model = {k: _as_bytes(v) for k, v in model.state_dict().items()}
        want_opt = {(i, k): _as_bytes(v) for i, st in opt.state_dict()["state"].items()
                    for k, v in st.items() if isinstance(v, torch.Tensor)}
        t = time.monotonic()
        if not snap.arena_ready(timeout):
            print(f"preflight FAILED: the staging arena was not ready after {timeout:.0f} s",
                  flush=True)
            return 1
        st = snap.stats()
        print(f"arena ready after {time.monotonic() - t:.2f} s", flush=True)
        snap.boundary(1)  # one submit: the copy of every tensor into the arena
        if not snap.wait(timeout=30):
            print("preflight FAILED: the snapshot of step 1 did not complete in 30 s", flush=True)
            return 1
        st = snap.stats()
        if st["snapshots"] < 1:
            print(f"preflight FAILED: boundary(1) made no snapshot (skipped {st['skipped']}, "
                  f"skipped_not_ready {st['skipped_not_ready']})", flush=True)
            return 1
        path = snap.flush(wait=True, timeout=30)  # fence: waits for the copy, writes it out
        if path is None or not Path(path).is_dir():
            print(f"preflight FAILED: flush() wrote nothing ({path})", flush=True)
            return 1
        print(f"submit + fence + flush: ok ({path}; {st['bytes']} bytes, copy "
              f"{(st['last_copy_seconds'] or 0) * 1e3:.1f} ms)", flush=True)
        staging = st["staging"] or {}
        reason = staging.get("fallback_reason")
        if device == "cuda":
            if not staging.get("page_locked"):
                print(f"preflight FAILED: the staging arena is not page-locked ({staging})",
                      flush=True)
                return 1
            if reason is None and staging.get("shared"):
                fact("cudaHostRegister", "ok: the shared /dev/shm arena is page-locked")
            else:
                fact("cudaHostRegister", f"REFUSED ({reason}): a process-private pinned arena "
                                         "is used; snapshots do not survive a crash")
        else:
            fact("cudaHostRegister", "- (CPU backend)")

        def reasons(obj: Any, prefix: str = "") -> Any:
            if isinstance(obj, dict):
                for k, v in obj.items():
                    yield from reasons(v, f"{prefix}{k}.")
            elif any(w in prefix.lower() for w in ("reason", "fallback", "error")):
                yield prefix[:-1], obj
        for k, v in reasons(st):
            print(f"fallback/reason {k}: {v}", flush=True)
        snap.close()  # removes the arena: the restore below reads the disk
        cpu_model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        cpu_opt = torch.optim.Adam(cpu_model.parameters(), lr=1e-3)
        snap2 = cudasnap.Snapshotter(cpu_model, cpu_opt, directory=d, job=f"{job}-cpu",
                                     health=False)
        start = snap2.restore_latest()
        got_model = {k: _as_bytes(v) for k, v in cpu_model.state_dict().items()}
        got_opt = {(i, k): _as_bytes(v) for i, s in cpu_opt.state_dict()["state"].items()
                   for k, v in s.items() if isinstance(v, torch.Tensor)}
        bad = [k for k in want_model if not torch.equal(got_model.get(k), want_model[k])]
        bad += [str(k) for k in want_opt if k not in got_opt or
                not torch.equal(got_opt[k], want_opt[k])]
        if start != 2 or bad or len(got_opt) != len(want_opt):
            print(f"preflight FAILED: the flushed snapshot does not restore bit for bit "
                  f"(restore_latest() -> {start}, differing: {bad[:6]})", flush=True)
            return 1
        fact("snapshot", f"step 1 completed, flushed and restored bit for bit "
                         f"({len(want_model) + len(want_opt)} tensors)")
    finally:
        snap.close()
        if snap2 is not None:
            snap2.close()
        shutil.rmtree(d, ignore_errors=True)
    print(f"preflight done in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


# ------------------------------------------------------------------ main
def gpu_probe() -> tuple[bool, str]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return False, f"torch is not importable ({type(e).__name__}: {e})"
    try:
        if not torch.cuda.is_available():
            return False, (f"torch {torch.__version__} (CUDA {torch.version.cuda}): "
                           "torch.cuda.is_available() is False")
    except Exception as e:  # noqa: BLE001
        return False, f"CUDA probe failed ({type(e).__name__}: {e})"
    return True, ""


def environment(a: argparse.Namespace, res: Results) -> None:
    import torch

    import cudasnap
    from cudasnap._native import native

    env = res.data["env"]
    env.update(torch=torch.__version__, cuda=torch.version.cuda,
               cudasnap=getattr(cudasnap, "__version__", "?"), build=dict(native().BUILD_INFO),
               python=sys.version.split()[0], cores=os.cpu_count(), machine=C.machine_line(),
               shm_free_gib=round(C.shm_free() / GiB, 1))
    if a.cpu_smoke:
        env.update(gpu="none (--cpu-smoke: CPU backend, numbers meaningless)", driver="-")
        print(f"env: {json.dumps(env, default=str)}", flush=True)
        return
    p = torch.cuda.get_device_properties(a.device)
    env.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
               gpu_mem_gib=round(p.total_memory / GiB, 1))
    if a.emulated:
        env.update(emulated=True, note=EMULATED_NOTE)
    try:
        import subprocess

        q = subprocess.run(["nvidia-smi", f"--id={a.device}", "--query-gpu=driver_version,"
                            "pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        parts = [x.strip() for x in q.stdout.strip().splitlines()[0].split(",")]
        env.update(driver=parts[0], pcie=f"gen{parts[1]} x{parts[2]}",
                   clocks=f"{parts[3]} / {parts[4]}")
    except Exception:  # noqa: BLE001 - no nvidia-smi (the emulator, some containers)
        env["driver"] = driver_version(a.device)
    if "cuda" not in env["build"].get("backends", []):
        raise RuntimeError("cudasnap._C was built without the CUDA backend: rebuild with "
                           "CUDASNAP_REQUIRE_CUDA=1 python setup.py build_ext --inplace")
    print(f"env: {json.dumps(env, default=str)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    global EMULATED
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.preflight:
        return preflight(a.preflight_device)
    if not a.cpu_smoke:
        ok, why = gpu_probe()
        if not ok and a.emulated:
            print(f"--emulated: torch sees no CUDA device ({why}); run under "
                  "tools/cudaemu/run.sh", flush=True)
            return 1
        if not ok:
            print(f"{SKIP_MSG} ({why})", flush=True)
            return 0
        emu = emulator_loaded()
        if a.emulated and not emu:
            print("--emulated: the emulated CUDA runtime is not loaded (a real device?); "
                  "run under tools/cudaemu/run.sh", flush=True)
            return 1
        if emu and not a.emulated:  # the emulator never stands in for a GPU measurement
            print("the CUDA device is the emulator (tools/cudaemu): running as --emulated",
                  flush=True)
            a = parse_args(argv + ["--emulated"])
        EMULATED = a.emulated
        if a.timing:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import modelled

            out = modelled.run(a.timing, a.quick)
            if not a.json:
                print(modelled.table(out), flush=True)
            print(json.dumps(out), flush=True)
            return 0
    res = Results(a.out, a.budget)
    install_watchdog(res, a.budget)
    status, rc = "complete", 0
    tmp = Path(tempfile.mkdtemp(prefix="cudasnap-gpubench-"))
    try:
        import logging

        logging.basicConfig(level=logging.WARNING, format="   %(name)s: %(message)s")
        import torch

        d2h = None
        try:
            if not a.cpu_smoke:
                torch.cuda.set_device(a.device)
            environment(a, res)
            if not a.cpu_smoke:
                d2h = D2H(a.device)
            res.data["env"]["copy_api"] = d2h.api if d2h is not None else "-"
        except Exception as e:  # noqa: BLE001 - nothing else can run
            res.error("env", e)
            a.sections, rc = [], 1
        plan: list[tuple[str, Callable[[], None]]] = [
            ("a", lambda: section_a(a, res, tmp, d2h)),
            ("c", lambda: section_c(a, res, tmp)),
            ("b", lambda: section_b(a, res, tmp)),
            ("d", lambda: section_d(a, res, tmp)),
        ]
        for name, fn in plan:
            if name not in a.sections:
                continue
            t0 = time.monotonic()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - keep the other sections
                res.error(name, e)
                rc = 1
                try:
                    release_gpu()
                except Exception:  # noqa: BLE001
                    pass
            print(f"-- section ({name}) took {time.monotonic() - t0:.1f} s "
                  f"(total {res.elapsed():.0f} s)", flush=True)
        if rc:
            status = "complete with errors"
    except BudgetExceeded as e:
        watchdog_caught()
        res.note(str(e))
        status, rc = f"PARTIAL ({e})", 3
    finally:
        watchdog_caught()
        C.rm(tmp)
        for p in Path("/dev/shm").glob(f"cudasnap-gpubench-{os.getpid()}*"):
            C.rm(p)
    res.finish(status)
    return rc


if __name__ == "__main__":
    sys.exit(main())
