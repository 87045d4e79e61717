"""torchtitan 0.3.0 on CPU/gloo for tests/e2e/test_torchtitan.py (issue 32): assets made here
(``assets.py``), a launcher that runs torchtitan's own train entry on CPU (``cpu_train.py``)
and the config that selects cudasnap's checkpoint manager (``cudasnap_cfg.py``)."""
