"""A warm server process that imported torch once and forks training children.

Starting a process that imports torch costs seconds on these machines, so the
torn-state and fault-matrix tests talk to one long-lived worker script over a
line protocol (JSON commands on stdin, text lines on stdout). This is the
shared client side: start, READY handshake, line queue, stderr tail, quit.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class LineServer:
    def __init__(self, script: Path, ready_timeout: float, drop_env: tuple[str, ...] = (),
                 stderr_lines: int = 40) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "CUDASNAP_HEALTH": "0"}
        for name in ("CUDASNAP_JOB", *drop_env):
            env.pop(name, None)
        self.name = script.stem
        self.stderr_lines = stderr_lines
        self.p = subprocess.Popen([sys.executable, "-u", str(script)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.q: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.p.stdout, self.q.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, self.err.append),
                         daemon=True).start()
        line = self.next(ready_timeout)
        assert line == "READY", (line, self.stderr())

    @staticmethod
    def _pump(stream: Any, put: Callable[[str], Any]) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def stderr(self) -> str:
        return "\n".join(self.err[-self.stderr_lines:])

    def next(self, timeout: float) -> str:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.name} silent for {timeout}s; stderr:\n{self.stderr()}") from None

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def close(self, timeout: float = 20.0) -> None:
        try:
            self.send(cmd="quit")
            self.p.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - a stuck server is killed
            self.p.kill()
            self.p.wait()
