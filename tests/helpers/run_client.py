"""Stand-in for ``python run_trainer.py ARGS`` under ``cudasnap run`` (no torch import here).

Asks the fork server at $CUDASNAP_TEST_FORKSERVER to fork a trainer with this
process's environment, working directory and arguments (its output goes to
$CUDASNAP_TEST_LOG), forwards SIGTERM/SIGINT/SIGUSR1 to it, and ends the way
the trainer ended: the same exit code, or killed by the same signal. The
supervisor therefore sees exactly what it would see with the real script;
the trainer is reaped before this process ends, so it is dead when the
supervisor flushes.
"""
import json
import os
import signal
import socket
import sys


def main() -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.environ["CUDASNAP_TEST_FORKSERVER"])
    f = s.makefile("rwb", buffering=0)
    req = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
           "log": os.environ.get("CUDASNAP_TEST_LOG", os.devnull)}
    f.write((json.dumps(req) + "\n").encode())
    pid = int(f.readline().split()[1])

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    line = f.readline()
    if not line.startswith(b"EXIT "):
        sys.exit(111)
    status = int(line.split()[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
