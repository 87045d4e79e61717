"""Shared helpers of the cudasnap benchmarks (bench/snapshot_cpu.py, jit_flush.py, peers.py).

Rules every script follows (see bench/RESULTS.md):
* tables print medians over repeats and ratios against baselines measured in
  the same run on the same bytes, never a lone absolute time;
* free RAM and /dev/shm space are checked before each case and the case is
  sized down, with a message, when it does not fit;
* file writes go to a temp dir on a real disk (never tmpfs) and are fsync'd;
  a file read back "from disk" has its page cache dropped first
  (posix_fadvise DONTNEED on that file only);
* memory is freed between cases (del + gc + malloc_trim).

Sizes are decimal: 1 GB = 1e9 bytes, GB/s = 1e9 bytes per second.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# dlrover's dependency `pynvml` (13.x) installs a redirector that warns on every
# `import pynvml` (torch.cuda does one); silence it before torch is imported.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GB = 1e9
MiB = 1 << 20


# ------------------------------------------------------------------ arguments
def parse_sizes(text: str) -> list[float]:
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if tok:
            v = float(tok)
            if v <= 0:
                raise argparse.ArgumentTypeError(f"size must be > 0 GB, got {tok}")
            out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("--sizes needs at least one size")
    return out


def base_parser(description: str, quick_sizes: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1,4"),
                   help="state sizes in GB (params + AdamW moments), comma-separated; default 1,4")
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement (median)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: sizes {quick_sizes} GB (overrides --sizes), 2 repeats")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON last line")
    p.add_argument("--tmp", default=None,
                   help="directory on a real disk for file writes (default: $TMPDIR or /var/tmp, "
                        "refused if tmpfs)")
    p.set_defaults(_quick_sizes=quick_sizes)
    return p


def finish_args(a: argparse.Namespace) -> argparse.Namespace:
    if a.quick:
        a.sizes = parse_sizes(a._quick_sizes)
        a.repeats = min(a.repeats, 2)
    if a.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    return a


# ------------------------------------------------------------------ machine
def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def ram_available() -> int:
    return meminfo()["MemAvailable"]


def shm_free(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fs_type(path: str | os.PathLike) -> str:
    """Filesystem type of the mount holding ``path`` (longest mount-point prefix)."""
    real = os.path.realpath(path)
    best, typ = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, typ = mnt, parts[2]
    return typ


def machine_line() -> str:
    mi = meminfo()
    return (f"{os.cpu_count()} cores, RAM {mi['MemTotal'] / GB:.1f} GB "
            f"(available {mi['MemAvailable'] / GB:.1f} GB), /dev/shm free {shm_free() / GB:.1f} GB")


def fit_size(size_gb: float, *, ram_per_gb: float, shm_per_gb: float, what: str,
             reserve_gb: float = 1.5) -> float | None:
    """Largest size <= ``size_gb`` (multiple of 0.25 GB) whose RAM and /dev/shm needs fit now.

    ``ram_per_gb`` counts everything the case holds at its peak, /dev/shm
    included (tmpfs counts against RAM); ``shm_per_gb`` is the /dev/shm part.
    Prints a message when the size had to shrink; returns None when even
    0.05 GB does not fit.
    """
    avail = ram_available() / GB - reserve_gb
    shm = shm_free() / GB - 0.25
    lim = min(avail / ram_per_gb, shm / shm_per_gb if shm_per_gb > 0 else float("inf"))
    if size_gb <= lim:
        return size_gb
    new = int(lim * 4) / 4 if lim >= 0.25 else round(lim, 2)
    if new < 0.05:
        print(f"!! {what}: {size_gb:g} GB needs ~{size_gb * ram_per_gb:.1f} GB RAM and "
              f"{size_gb * shm_per_gb:.1f} GB /dev/shm; only {avail:.1f} GB RAM / {shm:.1f} GB "
              f"shm free: skipped", flush=True)
        return None
    print(f"!! {what}: {size_gb:g} GB needs ~{size_gb * ram_per_gb:.1f} GB RAM "
          f"({size_gb * shm_per_gb:.1f} GB of it in /dev/shm) but {avail:.1f} GB RAM / "
          f"{shm:.1f} GB shm are free now: sized down to {new:g} GB", flush=True)
    return new


def disk_tmpdir(base: str | None, tag: str) -> Path:
    """A fresh temp dir on a real disk (refuses tmpfs/ramfs)."""
    candidates = [base] if base else [os.environ.get("TMPDIR"), "/var/tmp", str(REPO / "bench")]
    for c in candidates:
        if not c or not os.path.isdir(c):
            continue
        if fs_type(c) in ("tmpfs", "ramfs", "devtmpfs"):
            if base:
                raise SystemExit(f"--tmp {base} is on {fs_type(c)}: file writes must hit a real disk")
            continue
        return Path(tempfile.mkdtemp(prefix=f"cudasnap-bench-{tag}-", dir=c))
    raise SystemExit("no directory on a real disk found for file writes; pass --tmp DIR")


def disk_line(path: Path) -> str:
    st = os.statvfs(path)
    return f"{path} ({fs_type(path)}, {st.f_bavail * st.f_frsize / GB:.0f} GB free)"


# ------------------------------------------------------------------ memory
_libc = None


def free_mem() -> None:
    """gc + glibc malloc_trim so freed tensors go back to the OS before the next case."""
    global _libc
    gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except OSError:
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    m = re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


def _hwm_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS of this process during a phase, minus the RSS at its start.

    Uses the kernel's VmHWM, reset through /proc/self/clear_refs ("5", Linux
    >= 4.0) when allowed; else samples VmRSS every ``interval`` s in a thread.
    RSS includes touched /dev/shm pages this process maps (staging arenas).
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.base = 0
        self.peak = 0
        self.method = "?"
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def __enter__(self) -> "PeakRss":
        free_mem()
        self.base = rss_bytes()
        if _hwm_reset() and hwm_bytes() <= self.base + (64 << 20):
            self.method = "VmHWM"
        else:
            self.method = "sampled"
            self.peak = self.base
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        if self._t is not None:
            self._stop.set()
            self._t.join()
            self.peak = max(self.peak, rss_bytes())
        else:
            self.peak = hwm_bytes()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


# ------------------------------------------------------------------ files
def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (for peers that do not)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)
    fsync_dir(os.path.dirname(os.path.abspath(root)))


def drop_cache(path: str | os.PathLike) -> None:
    """Evicts one file's (clean) pages from the page cache, so a read hits the disk."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(dp, f) for dp, _d, fs in os.walk(path) for f in fs]
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rm(path: str | os.PathLike) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def raw_write_os(view: memoryview, path: Path) -> float:
    """``os.write`` of ``view`` (loop, 1 GiB per call) + fsync; returns seconds."""
    view = view.cast("B") if view.format != "B" else view
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        off, n = 0, len(view)
        while off < n:
            off += os.write(fd, view[off:off + (1 << 30)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    drop_cache(path)
    rm(path)
    return dt


def raw_write_native(ptr: int, nbytes: int, path: Path, threads: int = 1,
                     chunk: int = 4 * MiB, io_bytes: int = 16 * MiB) -> float:
    """``cudasnap._C.write_buffer_file`` (pwrite + CRC32C + fdatasync), ``threads`` threads."""
    from cudasnap._native import native

    t0 = time.perf_counter()
    native().write_buffer_file(ptr, nbytes, chunk, str(path), threads, io_bytes, True)
    dt = time.perf_counter() - t0
    drop_cache(path)
    rm(path)
    return dt


# ------------------------------------------------------------------ state
def build_state(total_gb: float, n_params: int, *, with_optimizer_state: bool = True,
                seed: int = 0) -> tuple[Any, Any]:
    """A model-like state: ``n_params`` float32 parameters + AdamW (exp_avg, exp_avg_sq, step).

    ``total_gb`` is params + both moments (3 x parameter bytes). The Adam state is
    created by one ``optimizer.step()`` on zero gradients, then filled with
    non-zero values; gradients are dropped afterwards (set_to_none) so later
    ``opt.step()`` calls only run the hooks (the snapshot fence), not the math.
    """
    import torch

    numel = max(1024, int(total_gb * GB / 12 / n_params))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.empty(numel)) for _ in range(n_params)])

    torch.manual_seed(seed)
    model = Model()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.001 * (i + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if with_optimizer_state:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for st in opt.state.values():
                st["exp_avg"].fill_(1e-3)
                st["exp_avg_sq"].fill_(1e-6)
    return model, opt


def flat_state(model: Any, opt: Any) -> dict[str, Any]:
    """name -> tensor for every tensor of the state (what dcp/torchsnapshot/DLRover save)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.{i}.{k}"] = v
    return out


def state_bytes(flat: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in flat.values())


def copy_into(live: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Restore = bytes back into the live tensors (what cudasnap's restore does)."""
    import torch

    with torch.no_grad():
        for k, t in live.items():
            t.copy_(loaded[k])


def init_dist(tmp: Path) -> None:
    """Single-rank gloo process group through a FileStore (for torch.distributed.checkpoint)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.FileStore(str(tmp / "pg-filestore"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


# ------------------------------------------------------------------ stats + output
def med(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: Any, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float):
        if unit == "x":
            return f"{x:.2f}x" if x < 100 else f"{x:,.0f}x"
        if abs(x) >= 100:
            return f"{x:,.0f}{unit}"
        return f"{x:.{digits}g}{unit}"
    return f"{x}{unit}"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]],
                note: str | None = None) -> str:
    """Prints (and returns) a GitHub-markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    lines = [f"### {title}", "",
             "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if note:
        lines += ["", note]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, default=lambda o: repr(o), separators=(",", ":")), flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
