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

    python bench/crc_bench.py [--repeats 15] [--json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--sizes-mib", default="4,256", help="buffer sizes in MiB, comma-separated")
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
    if a.json:
        C.emit_json({"bench": "crc", "results": {str(k): v for k, v in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
