"""Restore from an arena slot: the CRC32C pass starts before the slot manifest is parsed
(issue 15 target 6a: with 4,000 tensors the parse alone took ~20 ms ahead of the check),
and a manifest that fails after the check started still falls back cleanly."""
from __future__ import annotations

import torch
from helpers import parts

import cudasnap
from cudasnap.core import restore
from cudasnap.errors import CorruptSnapshot
from tools.faults.trainlib import adam_step as _step
from tools.faults.trainlib import small_adam as _adam

CHUNK = 64 << 10


def _two_slots(env):
    """Steps 0 and 1 in the two slots of the arena; returns the state at step 0 and 1."""
    model, opt = _adam(seed=0)
    snap = cudasnap.Snapshotter(model, opt, directory=env.dir, chunk_bytes=CHUNK)
    out = []
    try:
        for step in range(2):
            _step(model, opt)
            snap.boundary(step)
            assert snap.wait(60)
            out.append({k: v.clone() for k, v in model.state_dict().items()})
    finally:
        snap.close(keep_arena=True, flush=False)
    return out


def test_the_crc_check_starts_before_the_manifest_is_parsed(snap_env, monkeypatch):
    want = _two_slots(snap_env)
    events: list[str] = []

    class Spy(parts.verify_class()):
        def __init__(self, *a):
            events.append("crc")
            super().__init__(*a)

    parse = restore.fmt.parse_slot_meta

    def spy_parse(*a):
        events.append("parse")
        return parse(*a)

    parts.replace_verify_class(monkeypatch, Spy)
    monkeypatch.setattr(restore.fmt, "parse_slot_meta", spy_parse)
    model, opt = _adam(seed=1)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, chunk_bytes=CHUNK)
    try:
        assert snap.restore_latest() == 2
        assert events == ["crc", "parse"]
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[1][k]), k
    finally:
        snap.close()


def test_a_manifest_failing_beside_the_running_check_falls_back(snap_env, monkeypatch):
    want = _two_slots(snap_env)
    threads = []

    class Spy(parts.verify_class()):
        def __init__(self, *a):
            super().__init__(*a)
            threads.append(self._thread)

    parse = restore.fmt.parse_slot_meta
    calls = []

    def bad_first(*a):
        calls.append(1)
        if len(calls) == 1:  # the newest slot's manifest: "malformed"
            raise CorruptSnapshot("test: malformed slot manifest")
        return parse(*a)

    parts.replace_verify_class(monkeypatch, Spy)
    monkeypatch.setattr(restore.fmt, "parse_slot_meta", bad_first)
    model, opt = _adam(seed=1)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, chunk_bytes=CHUNK)
    try:
        assert snap.restore_latest() == 1  # the older slot, whole
        assert len(threads) == 2 and not any(t.is_alive() for t in threads)
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[0][k]), k
    finally:
        snap.close()
