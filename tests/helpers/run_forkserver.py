"""Warm fork server for tests/supervisor/test_run.py and tests/tools/test_cli.py (run with sys.executable).

A fresh Python process that imports torch and builds an optimizer costs
seconds on the test machines; this one does it once and forks a training
process (tools/faults/run_trainer.py) per request. Each forked process takes the
environment, working directory and arguments of the request, so it behaves
like ``python run_trainer.py ARGS`` started with that environment (by
``cudasnap run``, through helpers/run_client.py, or by a test directly).

Protocol (one Unix-socket connection per process, ``ARGV`` is run_trainer's):
    -> {"argv": [...], "env": {...}, "cwd": "...", "log": "FILE"}
    <- "PID pid"        once forked
    <- "EXIT status"    the raw waitpid status, once it has ended
    -> {"cmd": "quit"}  stops the server
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401  (the Snapshotter imports it)

import cudasnap  # noqa: E402,F401
import cudasnap.snapshotter  # noqa: E402,F401
import cudasnap.storage.posix  # noqa: E402,F401
import cudasnap.triggers  # noqa: E402,F401
import cudasnap.triggers.guard  # noqa: E402,F401
from cudasnap._native import native  # noqa: E402
from tools.faults import run_trainer  # noqa: E402

native()
torch.set_num_threads(1)
run_trainer.warm_up()  # still single-threaded: forking afterwards is safe


def child(req: dict, srv: socket.socket, conn: socket.socket) -> None:
    code = 3
    try:
        srv.close()
        conn.close()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        fd = os.open(req.get("log") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = [run_trainer.__file__, *req["argv"]]
        code = run_trainer.main(req["argv"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        # As the interpreter does for an uncaught exception: sys.excepthook, exit 1.
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:
            traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    path = sys.argv[1]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            f = conn.makefile("rwb", buffering=0)
            line = f.readline()
            if not line:
                continue
            req = json.loads(line)
            if req.get("cmd") == "quit":
                break
            pid = os.fork()
            if pid == 0:
                child(req, srv, conn)
            try:
                f.write(f"PID {pid}\n".encode())
            except OSError:
                pass
            _, status = os.waitpid(pid, 0)
            try:
                f.write(f"EXIT {status}\n".encode())
            except OSError:
                pass
    srv.close()


if __name__ == "__main__":
    main()
