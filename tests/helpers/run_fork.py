"""Test-side handle of the warm fork server (helpers/run_forkserver.py).

    server = ForkServer.start(tmpdir)
    proc = server.spawn(argv, env, log)      # a trainer, like Popen(run_trainer.py ARGV)
    proc.pid; proc.wait(timeout)             # returncode as subprocess gives it
    server.client_cmd(argv)                  # a command for supervise() / ``cudasnap run``
    server.stop()
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent


def returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Spawned:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._f = sock.makefile("rwb", buffering=0)
        self.pid = int(self._f.readline().split()[1])
        self.returncode: int | None = None

    def wait(self, timeout: float = 60.0) -> int:
        if self.returncode is None:
            self._sock.settimeout(timeout)
            line = self._f.readline()
            assert line.startswith(b"EXIT "), line
            self.returncode = returncode(int(line.split()[1]))
            self._sock.close()
        return self.returncode


class ForkServer:
    def __init__(self, proc: subprocess.Popen, path: Path) -> None:
        self.proc = proc
        self.path = path
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    @classmethod
    def start(cls, tmpdir: Path) -> "ForkServer":
        path = Path(tmpdir) / "forkserver.sock"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        for k in list(env):
            if k.startswith("CUDASNAP_"):
                del env[k]
        proc = subprocess.Popen([sys.executable, "-u", str(HERE / "run_forkserver.py"), str(path)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        line = proc.stdout.readline().strip()
        if line != "READY":
            proc.kill()
            raise RuntimeError(f"fork server did not start: {line!r} {proc.stderr.read()}")
        return cls(proc, path)

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(self.path))
        return s

    def spawn(self, argv: list[str], env: dict[str, str], log: Path | str,
              cwd: Path | str | None = None) -> Spawned:
        s = self._connect()
        req = {"argv": [str(x) for x in argv], "env": env, "cwd": str(cwd or os.getcwd()),
               "log": str(log)}
        s.sendall((json.dumps(req) + "\n").encode())
        return Spawned(s)

    def client_cmd(self, argv: list[str]) -> list[str]:
        return [sys.executable, str(HERE / "run_client.py"), *[str(x) for x in argv]]

    def client_env(self, log: Path | str) -> dict[str, str]:
        return {"CUDASNAP_TEST_FORKSERVER": str(self.path), "CUDASNAP_TEST_LOG": str(log)}

    def stop(self) -> None:
        try:
            s = self._connect()
            s.sendall(b'{"cmd": "quit"}\n')
            s.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
