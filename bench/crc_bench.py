"""CRC32C per-core throughput (issue 15, target 3): ours vs the PyPI packages.

One thread, the same bytes for every implementation, interleaved rounds
(implementation order rotates each round), median GB/s per implementation:

* ``cudasnap 3-way``: what ``cudasnap._C.crc32c`` runs on SSE4.2 CPUs (three
  crc32 instruction chains joined with zero-extension tables);
* ``cudasnap 1-way (old)``: the single-chain loop used before issue 15;
* ``cudasnap portable``: the slice-by-8 table fallback (no SSE4.2);
* ``crc32c`` and ``google-crc32c`` from PyPI where installed (else "not installed").

Buffer sizes: the 4 MiB copy chunk (cache-warm, as the copy engine checksums a
chunk it has just written) and a 256 MiB buffer (from memory).

Copy + checksum, one thread, 4 MiB chunks over a 256 MiB buffer (``--copy-mib``):
``memcpy`` alone, ``memcpy then crc32c`` (the copy engine's chunk copy before
the fused form: each byte read twice) and ``crc32c_copy`` (one read of the source
for both, what the CPU copy engine runs now).

Boundary -> COMPLETE (``--complete-gb``, CPU backend): a Snapshotter of that many
GB in 8 tensors, ``boundary()`` then ``wait()`` (copy + CRC per chunk + commit),
against a raw copy of the same tensors into a warm buffer on the same number of
threads (the native span copy, no checksum), interleaved.

    python bench/crc_bench.py [--repeats 15] [--copy-mib 256] [--complete-gb 0.5] [--json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# Every boundary copies (what these figures measure): the default overhead budget would
# skip boundaries once it has measured the cost (cudasnap.core.cadence). Old trees ignore it.
os.environ.setdefault("CUDASNAP_OVERHEAD_BUDGET", "0")


def candidates() -> dict[str, Callable[[Any], int] | str]:
    from cudasnap._native import native

    n = native()
    out: dict[str, Callable[[Any], int] | str] = {}
    if n.crc32c_hardware():
        out["cudasnap 3-way"] = lambda b: n._crc32c_impl(b, "sse42_3way")
        out["cudasnap 1-way (old)"] = lambda b: n._crc32c_impl(b, "sse42_1way")
    else:
        out["cudasnap 3-way"] = "CPU has no SSE4.2"
        out["cudasnap 1-way (old)"] = "CPU has no SSE4.2"
    out["cudasnap portable"] = lambda b: n._crc32c_impl(b, "portable")
    out["cudasnap crc32c() (dispatch)"] = lambda b: n.crc32c(b)
    try:
        import crc32c as pkg

        out["crc32c (PyPI)"] = pkg.crc32c
    except ImportError:
        out["crc32c (PyPI)"] = "not installed (pip install crc32c)"
    try:
        import google_crc32c

        out["google-crc32c (PyPI)"] = google_crc32c.value
    except ImportError:
        out["google-crc32c (PyPI)"] = "not installed (pip install google-crc32c)"
    return out


def measure(size: int, repeats: int) -> dict[str, Any]:
    import numpy as np

    buf = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    view = buf.tobytes()  # the packages take read-only bytes; ours any buffer
    cands = candidates()
    funcs = {k: v for k, v in cands.items() if callable(v)}
    want = funcs["cudasnap portable"](view)
    for name, fn in funcs.items():  # warm up + agree on the value
        got = fn(view)
        if got != want:
            raise SystemExit(f"{name} gives {got:#010x}, portable gives {want:#010x}")
    # enough calls per sample for ~20 ms at 5 GB/s
    calls = max(1, int(100e6 // size))
    samples: dict[str, list[float]] = {k: [] for k in funcs}
    names = list(funcs)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = funcs[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(view)
            dt = time.perf_counter() - t0
            samples[name].append(size * calls / dt / C.GB)
    res = {k: {"gbps": C.med(v), "samples": v} for k, v in samples.items()}
    for k, v in cands.items():
        if not callable(v):
            res[k] = {"gbps": None, "why": v}
    return res


def copy_measure(size: int, repeats: int, chunk: int = 4 * C.MiB) -> dict[str, Any]:
    """GB/s of a chunked copy alone, copy then checksum, and the fused copy+checksum."""
    import numpy as np

    from cudasnap._native import native

    n = native()
    src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    dst = np.ones_like(src)
    spans = range(0, size, chunk)

    def memcpy() -> None:
        for o in spans:
            np.copyto(dst[o:o + chunk], src[o:o + chunk])

    def separate() -> None:
        for o in spans:
            np.copyto(dst[o:o + chunk], src[o:o + chunk])
            n.crc32c(dst[o:o + chunk])

    def fused() -> None:
        for o in spans:
            n.crc32c_copy(dst[o:o + chunk], src[o:o + chunk])

    funcs = {"memcpy": memcpy, "memcpy then crc32c (old)": separate, "crc32c_copy (fused)": fused}
    for f in funcs.values():
        f()  # fault and warm both buffers
    samples: dict[str, list[float]] = {k: [] for k in funcs}
    names = list(funcs)
    for r in range(repeats):
        for name in names[r % 3:] + names[:r % 3]:
            t0 = time.perf_counter()
            funcs[name]()
            samples[name].append(size / (time.perf_counter() - t0) / C.GB)
    return {k: {"gbps": C.med(v), "samples": v} for k, v in samples.items()}


def complete_measure(gb: float, repeats: int) -> dict[str, Any]:
    """boundary() -> COMPLETE on the CPU backend vs a raw threaded copy of the same bytes."""
    import tempfile

    import torch

    import cudasnap
    from cudasnap._native import native

    model, opt = C.build_state(gb, 2)
    tensors = list(C.flat_state(model, opt).values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(tensors)}
    with tempfile.TemporaryDirectory() as d:
        snap = cudasnap.Snapshotter(model, opt, directory=d, job=f"crcb-{os.getpid()}",
                                    health=False, flush_on_close=False)
        try:
            threads = snap.copy_threads
            dst = torch.ones(nbytes, dtype=torch.uint8)
            base = dst.data_ptr()
            n = native()

            def raw() -> None:
                off = 0
                for t in tensors:
                    b = t.numel() * t.element_size()
                    n.copy_spans(t.data_ptr(), b, [(base + off, 0, b)], threads)
                    off += b

            step = 0
            snap.boundary(step)
            snap.arena_ready()
            for _ in range(3):  # every slot written once (faulted), caches as in training
                step += 1
                snap.wait()
                snap.boundary(step)
            snap.wait()
            raw()
            comp: list[float] = []
            rawt: list[float] = []
            for r in range(repeats):
                for which in (("snap", "raw") if r % 2 == 0 else ("raw", "snap")):
                    if which == "raw":
                        t0 = time.perf_counter()
                        raw()
                        rawt.append(time.perf_counter() - t0)
                    else:
                        step += 1
                        t0 = time.perf_counter()
                        snap.boundary(step)
                        if not snap.wait(600):
                            raise SystemExit("snapshot did not complete in 600 s")
                        comp.append(time.perf_counter() - t0)
            out.update(threads=threads, complete_s=comp, raw_s=rawt,
                       snapshots=snap.stats()["snapshots"])
        finally:
            snap.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--sizes-mib", default="4,256", help="buffer sizes in MiB, comma-separated")
    p.add_argument("--copy-mib", type=int, default=256,
                   help="buffer of the copy + checksum comparison (0: skip)")
    p.add_argument("--complete-gb", type=float, default=0.5,
                   help="state of the boundary -> COMPLETE comparison (0: skip)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    print(f"# crc_bench: {time.strftime('%Y-%m-%d %H:%M:%S')}; {C.machine_line()}", flush=True)
    print(f"# one thread, median of {a.repeats} interleaved rounds\n", flush=True)
    results = {}
    for s in [int(x) for x in a.sizes_mib.split(",")]:
        results[s] = measure(s * C.MiB, a.repeats)
    base = "cudasnap 1-way (old)"
    rows = []
    for name in next(iter(results.values())):
        row: list[Any] = [name]
        for s, res in results.items():
            g = res[name]["gbps"]
            b = res.get(base, {}).get("gbps")
            row += [C.fmt(g, " GB/s") if g is not None else res[name]["why"],
                    C.fmt(C.ratio(g, b), "x") if g is not None and b else "-"]
        rows.append(row)
    heads = ["implementation"]
    for s in results:
        heads += [f"{s} MiB buffer", f"vs 1-way (old), {s} MiB"]
    C.print_table("CRC32C per core (median GB/s, one thread, same bytes, same run)", heads, rows,
                  "target (issue 15): cudasnap 3-way >= 2x the old 1-way per core.")
    out: dict[str, Any] = {"bench": "crc", "results": {str(k): v for k, v in results.items()}}
    if a.copy_mib > 0:
        cp = copy_measure(a.copy_mib * C.MiB, a.repeats)
        out["copy"] = cp
        mc = cp["memcpy"]["gbps"]
        C.print_table(
            f"Copy + checksum, one thread, 4 MiB chunks over {a.copy_mib} MiB (median GB/s)",
            ["form", "GB/s", "vs memcpy", "vs memcpy then crc32c"],
            [[k, C.fmt(v["gbps"], " GB/s"), C.fmt(C.ratio(v["gbps"], mc), "x"),
              C.fmt(C.ratio(v["gbps"], cp["memcpy then crc32c (old)"]["gbps"]), "x")]
             for k, v in cp.items()],
            "crc32c_copy is the CPU copy engine's chunk copy: each source byte is read once "
            "for the copy and its checksum.")
    if a.complete_gb > 0:
        cm = complete_measure(a.complete_gb, max(3, a.repeats // 2))
        out["complete"] = cm
        c, r = C.med(cm["complete_s"]), C.med(cm["raw_s"])
        C.print_table(
            f"boundary() -> COMPLETE vs a raw copy of the same bytes ({cm['bytes'] / C.GB:.2f} GB, "
            f"{cm['tensors']} tensors, {cm['threads']} copy threads, CPU backend, median)",
            ["boundary -> COMPLETE", "raw copy (same threads)", "COMPLETE / raw", "<= 1.2x?"],
            [[C.fmt(c, " s"), C.fmt(r, " s"), C.fmt(C.ratio(c, r), "x"),
              "yes" if c is not None and r and c / r <= 1.2 else "NO"]],
            "COMPLETE includes the per-chunk CRC32C, the chunk table and the commit; the raw "
            "copy is cudasnap's span copy with no checksum. On CUDA the copy is a DMA and the "
            "CRC runs on host threads as chunk groups land (bench/gpu_bench.py).")
    if a.json:
        C.emit_json(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
