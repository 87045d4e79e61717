"""cudasnap.tools.metrics: Prometheus text exposition of Snapshotter.stats() and the /metrics server."""
from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest
from helpers import parts

from cudasnap.tools.metrics import CONTENT_TYPE, TimingHistograms, prometheus_text, serve_metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')

FULL = {"snapshots": 12, "skipped": 1, "bytes": 4096, "boundary_us_median": 41.5,
        "fence_wait_s": 0.002, "last_copy_seconds": 0.001, "last_copy_gbps": 4.096,
        "flushes": 2, "last_flush_seconds": 0.25, "last_flush_path": "/x/step-00000011",
        "arena_setup_seconds": 0.01, "health_events": 3, "layout_rebuilds": 1,
        "restore": {"source": "shm", "step": 7, "seconds": 0.05, "where": "/dev/shm/a"},
        "backend": "cpu"}


def parse(text: str) -> dict[str, dict]:
    """A strict reader of the text format: {family: {"type", "help", "samples": [(labels, v)]}}."""
    assert text.endswith("\n")
    fams: dict[str, dict] = {}
    for line in text.splitlines():
        assert line.strip() == line and line, f"stray whitespace or empty line: {line!r}"
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            fams.setdefault(name, {"samples": []})["help"] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            fam = fams.setdefault(name, {"samples": []})
            assert "type" not in fam and not fam["samples"], f"TYPE after samples: {line}"
            fam["type"] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, _, body, value = m.groups()
            for suffix in ("_bucket", "_sum", "_count"):  # histogram samples belong to their family
                base = name.removesuffix(suffix)
                if base != name and fams.get(base, {}).get("type") == "histogram":
                    name = base
            assert name in fams and "type" in fams[name], f"sample before its TYPE: {line}"
            labels = {}
            pos = 0
            while body and pos < len(body):
                lm = _LABEL.match(body, pos)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = re.sub(r"\\(.)", lambda x: {"n": "\n"}.get(x.group(1),
                                                                                   x.group(1)),
                                             lm.group(2))
                pos = lm.end()
            fams[name]["samples"].append((labels, float(value)))
            fams[name].setdefault("lines", []).append(m.group(1))
    for name, fam in fams.items():
        assert "help" in fam and "type" in fam and fam["samples"], name
        if fam["type"] == "counter":
            assert name.endswith("_total"), name
    return fams


def value(fams: dict, name: str) -> float:
    (labels, v), = fams[name]["samples"]
    return v


def test_text_format_full_stats() -> None:
    fams = parse(prometheus_text(FULL, labels={"job": "llm", "rank": 0}))
    expect = {"cudasnap_snapshots_total": ("counter", 12), "cudasnap_snapshots_skipped_total":
              ("counter", 1), "cudasnap_snapshot_bytes": ("gauge", 4096),
              "cudasnap_last_copy_gigabytes_per_second": ("gauge", 4.096),
              "cudasnap_last_flush_seconds": ("gauge", 0.25), "cudasnap_flushes_total":
              ("counter", 2), "cudasnap_health_events_total": ("counter", 3),
              "cudasnap_boundary_median_microseconds": ("gauge", 41.5),
              "cudasnap_restored_step": ("gauge", 7)}
    for name, (kind, v) in expect.items():
        assert fams[name]["type"] == kind
        assert value(fams, name) == v
    for name, fam in fams.items():
        for labels, _ in fam["samples"]:
            assert labels["job"] == "llm" and labels["rank"] == "0", name
    (info_labels, one), = fams["cudasnap_info"]["samples"]
    assert one == 1 and info_labels["backend"] == "cpu" and info_labels["restore_source"] == "shm"


def test_unknown_values_are_omitted_and_labels_escaped() -> None:
    fresh = {"snapshots": 0, "skipped": 0, "bytes": 0, "boundary_us_median": None,
             "last_copy_gbps": None, "last_flush_seconds": None, "flushes": 0,
             "health_events": 0, "restore": None, "backend": None}
    text = prometheus_text(fresh, labels={"path": 'a"b\\c\nd'})
    fams = parse(text)
    assert "cudasnap_last_copy_gigabytes_per_second" not in fams
    assert "cudasnap_boundary_median_microseconds" not in fams
    assert value(fams, "cudasnap_snapshots_total") == 0
    assert fams["cudasnap_snapshots_total"]["samples"][0][0]["path"] == 'a"b\\c\nd'
    assert parse(prometheus_text(None))["cudasnap_info"]["samples"][0][0]["backend"] == "none"
    assert "NaN" in prometheus_text({"last_copy_gbps": float("nan")})
    with pytest.raises(ValueError):
        prometheus_text(FULL, labels={"bad-name": 1})
    with pytest.raises(ValueError):
        prometheus_text(FULL, labels={"__reserved": 1})


def test_real_snapshotter_stats(snap_env) -> None:
    import torch

    import cudasnap

    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snap = cudasnap.Snapshotter(model, opt, directory=snap_env.dir, copy_threads=1)
    try:
        for step in range(4):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            snap.boundary(step)
        snap.flush()
        fams = parse(prometheus_text(snap.stats(), labels={"rank": snap.rank}))
    finally:
        snap.close()
    assert value(fams, "cudasnap_snapshots_total") == 4
    assert value(fams, "cudasnap_flushes_total") == 1
    assert value(fams, "cudasnap_snapshot_bytes") >= (16 * 16 + 16) * 4 * 2
    assert value(fams, "cudasnap_last_flush_seconds") >= 0
    assert value(fams, "cudasnap_boundary_median_microseconds") >= 0
    assert fams["cudasnap_info"]["samples"][0][0]["backend"] == "cpu"


class _Fake:
    def __init__(self) -> None:
        self.calls = 0

    def stats(self) -> dict:
        self.calls += 1
        return dict(FULL, snapshots=self.calls)


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_server_serves_metrics_on_loopback() -> None:
    src = _Fake()
    with serve_metrics(src, 0, labels={"job": "t"}) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        assert parts.metrics_thread(server).daemon
        code, ctype, body = _get(server.url)
        assert code == 200 and ctype == CONTENT_TYPE
        assert value(parse(body), "cudasnap_snapshots_total") == 1
        code, _, body = _get(server.url + "?x=1")  # read fresh on every scrape
        assert code == 200 and value(parse(body), "cudasnap_snapshots_total") == 2
        code, _, _ = _get(f"http://127.0.0.1:{server.port}/other")
        assert code == 404
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)
    with pytest.raises(TypeError):
        serve_metrics(object(), 0)


def test_server_reports_a_failing_source() -> None:
    class Broken:
        def stats(self) -> dict:
            raise RuntimeError("boom")

    with serve_metrics(Broken(), 0) as server:
        code, _, body = _get(server.url)
    assert code == 500 and "boom" in body


def test_histograms_count_real_observations() -> None:
    t = TimingHistograms(boundary_buckets=(1e-5, 1e-4), copy_buckets=(0.1, 1.0))
    for v in (5e-6, 2e-5, 3e-5, 0.5):
        t.observe_boundary(v)
    t.observe_copy(0.05)
    t.observe_copy(2.0)
    fams = parse(prometheus_text(FULL, labels={"rank": 0}, timings=t))
    b = fams["cudasnap_boundary_seconds"]
    assert b["type"] == "histogram"
    got = {(lines, lab.get("le")): v for (lab, v), lines in zip(b["samples"], b["lines"])}
    assert got[("cudasnap_boundary_seconds_bucket", "1e-05")] == 1
    assert got[("cudasnap_boundary_seconds_bucket", "0.0001")] == 3
    assert got[("cudasnap_boundary_seconds_bucket", "+Inf")] == 4
    assert got[("cudasnap_boundary_seconds_count", None)] == 4
    assert abs(got[("cudasnap_boundary_seconds_sum", None)] - (5e-6 + 2e-5 + 3e-5 + 0.5)) < 1e-12
    c = {(lines, lab.get("le")): v for (lab, v), lines in zip(fams["cudasnap_copy_seconds"]["samples"],
                                                              fams["cudasnap_copy_seconds"]["lines"])}
    assert (c[("cudasnap_copy_seconds_bucket", "0.1")], c[("cudasnap_copy_seconds_bucket", "1.0")],
            c[("cudasnap_copy_seconds_count", None)]) == (1, 1, 2)
    assert all(lab["rank"] == "0" for lab, _ in b["samples"])


def test_server_serves_the_histograms_it_was_given() -> None:
    with serve_metrics(_Fake(), 0) as server:
        server.timings.observe_copy(0.3)
        code, _, body = _get(server.url)
    fams = parse(body)

    def count(name: str) -> float:
        fam = fams[name]
        (v,) = [v for (_, v), line in zip(fam["samples"], fam["lines"]) if line == name + "_count"]
        return v

    assert code == 200 and count("cudasnap_copy_seconds") == 1 and count("cudasnap_boundary_seconds") == 0


def test_without_prometheus_client_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match="pip install 'prometheus-client"):
        prometheus_text(FULL)
    with pytest.raises(ImportError, match="prometheus_client"):
        serve_metrics(_Fake(), 0)
