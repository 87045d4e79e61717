"""torchtitan 0.3.0 on CPU/gloo for tests/e2e/test_torchtitan.py (issue 32): the config that
selects cudasnap's checkpoint manager with a self-kill (``cudasnap_cfg.py``); the assets,
the CPU launcher and the plain config live in tools/stacks (the kill harness uses them)."""
