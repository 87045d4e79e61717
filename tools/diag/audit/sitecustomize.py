"""Diagnostic (issue 14 flake hunt): logs the Python stack of every os.remove/os.rename of a
cudasnap base arena, and every shutil.rmtree of a path containing "shm", to /tmp/unl/pylog.

Use: ``PYTHONPATH=tools/diag/audit LD_PRELOAD=/tmp/unl/unlink_watch.so make test`` (build the
shim with ``gcc -O1 -shared -fPIC -o /tmp/unl/unlink_watch.so tools/diag/unlink_watch.c -ldl``;
``mkdir -p /tmp/unl`` first). Not imported by cudasnap or the tests.
"""
import os
import sys
import traceback


def _hook(ev: str, args: tuple) -> None:
    if ev in ("os.remove", "os.rename", "shutil.rmtree") and args:
        p = str(args[0])
        if ("cudasnap-" in p and "-base" in p) or (ev == "shutil.rmtree" and "shm" in p):
            with open("/tmp/unl/pylog", "a") as f:
                f.write(f"--- {ev} {p} pid={os.getpid()}\n"
                        + "".join(traceback.format_stack()[-12:]))


sys.addaudithook(_hook)
