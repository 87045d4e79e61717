"""`cudasnap advise` and host memory (issue 15 target 7) and the snapshot_every pick (target 5)."""
from __future__ import annotations

import json

from cudasnap.core.host_fit import host_fit, pick_snapshot_every
from cudasnap.tools import cli

GB = 10**9


def test_host_fit_counts_slots_spare_and_ranks():
    ok = host_fit(1.0, 2, shm_free=100 * GB, mem_available=100 * GB)
    assert ok["fits"] and ok["slots"] == 3 and 6 * GB < ok["need_bytes"] < 6.2 * GB
    bad = host_fit(10.0, 8, shm_free=100 * GB, mem_available=300 * GB)
    assert not bad["fits"] and "DOES NOT FIT" in bad["message"]
    assert "/dev/shm free is 100 GB" in bad["message"] and "MemAvailable" not in bad["message"]
    assert "spare_slot=False needs" in bad["message"]
    tight = host_fit(10.0, 8, num_slots=2, spare_slot=False, shm_free=500 * GB,
                     mem_available=100 * GB)
    assert not tight["fits"] and "MemAvailable is 100 GB" in tight["message"]


def test_snapshot_every_covers_one_copy():
    assert pick_snapshot_every(1.0, 1.0, copy_gbps=20)["snapshot_every"] == 1
    k = pick_snapshot_every(80.0, 0.5, copy_gbps=20)
    assert k["snapshot_every"] == 8 and "replays <= 8" in k["message"]


def test_advise_reports_host_memory_and_k(capsys):
    assert cli.main(["advise", "--gpus", "64", "--mtbf-hours", "20000", "--iter-seconds", "1",
                     "--state-gb", "1e6", "--gpus-per-node", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["host_memory"]["fits"] is False and "DOES NOT FIT" in d["host_memory"]["message"]
    assert d["snapshot_every"]["snapshot_every"] >= 1
    assert cli.main(["advise", "--gpus", "8", "--mtbf-hours", "20000", "--iter-seconds", "1",
                     "--state-gb", "1e6"]) == 0
    out = capsys.readouterr().out
    assert "host memory: DOES NOT FIT" in out and "snapshot_every=" in out
