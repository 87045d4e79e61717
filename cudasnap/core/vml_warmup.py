"""One-element warm-up of oneMKL's VML functions, so two runs of a script compute alike.

ATen routes contiguous float unary ops (``sqrt``, ``exp``, ``log``, ``tanh``, ...) on
the CPU to MKL VML, one call per intra-op thread on its chunk. oneMKL 2024.2 (bundled
in torch CPU wheels) resolves each VML function's kernel on its first call; when that
first call runs on several threads at once, one thread can run the low-accuracy AVX2 EP
kernel on its whole chunk despite the high-accuracy mode ATen asks for
(pytorch/pytorch#188792, fix proposed in pytorch/pytorch#188791). Training is then
not reproducible from step 0: observed here as AdamW's first ``exp_avg_sq.sqrt()``
computed as ``x * rsqrtps(x)`` (relative error up to 3.3e-4) on the main thread's half
of a 512x512 weight in about 1 of 80 fresh processes on a loaded 2-core VM, so an
uninterrupted run and a killed-and-resumed one differed although every snapshot was
exact (tests/e2e/test_readme_quickstart.py).

cudasnap promises a resume bitwise equal to a run that never failed, which needs the
run itself to be reproducible: the Snapshotter's constructor calls :func:`warm` once
per process, before the training loop's first op, on the constructing thread — each
VML function on one element, single-threaded, so the dispatch is resolved before any
concurrent use (the same warm-up as pytorch#188791). ~30 tiny CPU ops, once; never
touches CUDA. A VML call made before the Snapshotter exists (e.g. in model set-up) is
outside its reach: such a script can warm up itself or run with one intra-op thread.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("cudasnap")

# The float unary ops ATen's vml.h sends to MKL (IMPLEMENT_VML_MKL), torch 2.6-2.15.
OPS = ("sqrt", "exp", "log", "log10", "sin", "cos", "tan", "tanh", "asin", "acos",
       "atan", "erf", "erfc", "erfinv", "trunc")

_lock = threading.Lock()
_done = False


def warm() -> bool:
    """Calls each of :data:`OPS` once on a one-element float32 and float64 tensor.

    Returns True when it ran now, False when it had already run in this process or
    torch has no MKL (nothing to warm). Errors are logged, never raised: a missing
    op in some torch version must not stop a Snapshotter from being built."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        import torch

        if not torch.backends.mkl.is_available():
            return False
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)
            for name in OPS:
                try:
                    getattr(torch, name)(x)
                except (AttributeError, RuntimeError) as e:
                    log.debug("VML warm-up: torch.%s(%s) failed: %s", name, dtype, e)
        return True


def warmed() -> bool:
    """Whether :func:`warm` has run in this process."""
    return _done
