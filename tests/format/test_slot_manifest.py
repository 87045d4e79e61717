"""The one writer of the slot-manifest bytes (issue 24): ``cudasnap.format.slot_manifest``.

The bytes a real boundary leaves in a slot (prefix per layout, host pieces per
boundary, written by the native copy engine one after the other) parse with the
format's parser and equal the writer's whole-text output for the same inputs; the
prefix is byte for byte what the hand-built one was.
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers import parts

import cudasnap
from cudasnap.core import plan_cache as core_layout
from cudasnap.core.rng import DRAWN_KEY
from cudasnap.format import codec
from cudasnap.format import manifest as fmt
from cudasnap.format import slot_manifest as sm


def _old_prefix(head: dict, entries: list) -> bytes:
    """cudasnap.core.plan_cache's prefix before the writer moved to cudasnap.format."""
    return (json.dumps(head, separators=(",", ":"))[:-1] + ',"tensors":' +
            json.dumps(entries, separators=(",", ":")) + ',"host":').encode()


def test_prefix_bytes_are_unchanged():
    head = fmt.head(rank=1, world_size=2, job="jöb-\"x\"", backend="cpu", torch="2.5.0",
                    dcp_names={"model": {"w": "w"}, "optim": {"0": ["w", None]}})
    t = torch.zeros(4, 8)
    entries = [fmt.tensor_entry("model.w", "model:m", t, 0, 1),
               {**fmt.tensor_entry("optim.0.exp_avg", "optim:o", t, 128, 0), "param_index": 0,
                "state_key": "exp_avg", "aliases": ["model.v"]}]
    got = sm.encode_prefix(head, entries)
    assert got == _old_prefix(head, entries)
    assert got.startswith(b'{"format":"cudasnap","format_version":1,"rank":1,')
    assert got.endswith(b'],"host":')
    assert sm.encode_prefix(fmt.head(), []) == b'{"format":"cudasnap","format_version":1,' \
        b'"tensors":[],"host":'


def test_host_pieces_equal_the_whole_text():
    host = {"step": 7, "rng": {"torch": b"\x00\x01", "python": (3, (1, 2), None)},
            "optim": {"o": {"param_groups": [{"lr": float("nan"), "params": [0, 2]}]}},
            "extra": {}, "values": {"loss": -0.0}}
    whole = sm.encode_host(host)
    rng = sm.rng_pieces([sm.rng_member(k, sm.host_value(v, "x")) for k, v in host["rng"].items()])
    pieces = sm.host_open(rng, 7)
    pieces += [sm.host_member(k, sm.host_value(host[k], "x")) for k in ("optim", "values")]
    pieces += [sm.EMPTY_EXTRA, sm.HOST_CLOSE]
    assert json.loads(b"".join(pieces)) == json.loads(whole)
    assert whole.startswith(b'{"rng":{"torch":') and b'},"step":7,"optim":' in whole
    assert json.loads(whole) == json.loads(codec.dumps(host, "host"))
    empty = {"step": 1, "rng": {}, "optim": {}, "extra": {}}
    assert sm.encode_host(empty) == b'{"rng":{},"step":1,"optim":{},"extra":{}}'
    assert sm.slot_tail(12) == b',"step":12}'
    whole = sm.encode_slot_manifest(fmt.head(), [], empty, 1)
    meta = fmt.parse_slot_meta(whole, "slot")
    fmt.validate_manifest(meta, "slot", need_data=False)
    assert meta["step"] == 1 and meta["host"]["step"] == 1


def test_names_the_codec_would_tag_are_refused():
    with pytest.raises(ValueError, match="__x"):
        sm.host_member("__x", "1")
    with pytest.raises(ValueError, match="__float__"):
        sm.rng_member("__float__", "1")
    assert sm.host_value(float("nan"), "x") == '{"__float__":"nan"}'  # tagged by the codec
    with pytest.raises(ValueError, match="Out of range"):  # anything left is refused
        parts.compact_dumps([float("inf")])  # the encoder host_value (codec.dumps) uses


def test_a_real_boundary_writes_the_writers_bytes(snap_env, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tables: list[list] = []
    real = core_layout.encode_prefix

    def spy(head, entries):  # the layout's tensor table: the writer's input
        tables.append(entries)
        return real(head, entries)

    monkeypatch.setattr(core_layout, "encode_prefix", spy)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, backend="cpu", health=False,
                                flush_on_close=False)
    try:
        for step in range(6):
            values = {}
            if step == 2:
                opt.param_groups[0]["lr"] = 5e-4
            elif step == 3:
                torch.rand(2)  # the torch RNG source changed
            elif step == 5:
                values = {"loss": 1.5, "seen": [1, 2]}
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            snap.boundary(step, **values)
            snap.wait()
            raw = parts.arena(snap).read_meta(parts.arena(snap).newest_complete())
            meta = fmt.parse_slot_meta(raw, "slot")
            fmt.validate_manifest(meta, "slot", need_data=False)
            assert meta["step"] == meta["host"]["step"] == step
            st = snap.state
            host = st.capture_host(step)  # nothing drew since the boundary
            assert codec.decode(meta["host"], "host")["rng"] == host["rng"]
            # The boundary writes the RNG sources in rng_sources' order.
            host["rng"] = {k: host["rng"][k] for k in st.rng_sources if k in host["rng"]}
            # The torch draw before step 3's forward is seen by the probe after boundary 2:
            # from boundary 3 on each snapshot says so (cudasnap.core.rng.RestoredRng).
            assert (DRAWN_KEY in host.get("values", {})) is (step >= 3), (step, host)
            if host.get("values"):
                # Unchanged param groups are written after the members captured again.
                host = {k: host[k] for k in ("rng", "step", "extra", "values", "optim")}
            head = fmt.head(rank=snap.rank, world_size=snap.world_size, job=snap.job,
                            backend="cpu", torch=torch.__version__, dcp_names=st.dcp_names())
            assert raw == sm.encode_slot_manifest(head, tables[-1], host, step), step
        assert len(tables) == 1  # one layout: its prefix was reused at every boundary
        assert meta["tensors"] == tables[0]
    finally:
        snap.close()
