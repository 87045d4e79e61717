"""``cudasnap run``: the crash supervisor around a training command, and its warm standby.

A process of its own, above the library: it starts the training command, waits for it,
flushes what a dead attempt left in shared memory and restarts it. Modules, in call order:

- :mod:`.run`: the command line (``cudasnap run [options] -- cmd ...``): :func:`main`.
- :mod:`.loop`: :func:`supervise`, the restart loop and its verdict after each death.
- :mod:`.directory`: the snapshot directory: URL refusal, the supervisor lock, the check
  that no other job (or an orphan of a dead supervisor) holds it, the resume point, ``--fresh``.
- :mod:`.child`: one attempt's process: its cold command, waiting (SIGSTOP, watchdog, hang
  policy), how it ended, the configuration error it reported.
- :mod:`.orphans`: the flush of a dead attempt's newest COMPLETE shared-memory slots.
- :mod:`.standby`: the warm next-attempt interpreter (also the attempt's side:
  ``python -m cudasnap.supervisor.standby``).

This package imports nothing at import time: the standby's interpreter imports it first.
"""
