"""Prometheus metrics for a Snapshotter, through ``prometheus_client`` (optional extra).

    from cudasnap.tools.metrics import SnapshotterCollector, prometheus_text, serve_metrics
    text = prometheus_text(snap.stats(), labels={"job": "llm", "rank": "0"})
    server = serve_metrics(snap, port=9400)      # GET http://127.0.0.1:9400/metrics
    server.timings.observe_boundary(0.00004)     # real histograms (see TimingHistograms)
    server.close()

Stats are read on each scrape (``stats()`` copies counters, it never waits for a
copy or a flush) by :class:`SnapshotterCollector`; ``prometheus_client`` renders
the text format (0.0.4) and serves it. Metric names follow the Prometheus
conventions (``cudasnap_`` prefix, ``_total`` for counters); a value the
Snapshotter does not know yet (no copy completed, no flush) is left out.
Without ``prometheus_client`` every entry point raises an ImportError naming the
package to install.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

log = logging.getLogger("cudasnap.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_MISSING = ("cudasnap.tools.metrics needs the optional package prometheus_client: "
            "pip install 'prometheus-client>=0.20' (pinned in requirements-dev.txt)")


def _prom() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.exposition
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    return prometheus_client


# (metric name, type, help, function of the stats dict returning a number or None).
# Counter names carry _total here; prometheus_client adds it back when rendering.
_METRICS: list[tuple[str, str, str, Callable[[Mapping[str, Any]], Any]]] = [
    ("cudasnap_snapshots_total", "counter",
     "Snapshots submitted to the staging arena.", lambda s: s.get("snapshots")),
    ("cudasnap_snapshots_skipped_total", "counter",
     "Boundaries not snapshotted (every slot busy, or staging failed).",
     lambda s: s.get("skipped")),
    ("cudasnap_snapshot_bytes", "gauge",
     "Bytes in one snapshot (the copy plan's total).", lambda s: s.get("bytes")),
    ("cudasnap_last_copy_gigabytes_per_second", "gauge",
     "Copy bandwidth of the last completed snapshot, in GB/s (1e9 bytes).",
     lambda s: s.get("last_copy_gbps")),
    ("cudasnap_last_copy_seconds", "gauge",
     "Duration of the last completed snapshot copy.", lambda s: s.get("last_copy_seconds")),
    ("cudasnap_flushes_total", "counter",
     "Snapshots written to disk by this process.", lambda s: s.get("flushes")),
    ("cudasnap_last_flush_seconds", "gauge",
     "Duration of the last flush to disk.", lambda s: s.get("last_flush_seconds")),
    ("cudasnap_health_events_total", "counter",
     "Health and trigger events seen by the guard.", lambda s: s.get("health_events")),
    ("cudasnap_boundary_median_microseconds", "gauge",
     "Median time boundary() blocked the training thread, in microseconds.",
     lambda s: s.get("boundary_us_median")),
    ("cudasnap_fence_wait_seconds_total", "counter",
     "Time the training thread waited on copy fences.", lambda s: s.get("fence_wait_s")),
    ("cudasnap_layout_rebuilds_total", "counter",
     "Copy-plan rebuilds (state tensors allocated or replaced).",
     lambda s: s.get("layout_rebuilds")),
    ("cudasnap_arena_setup_seconds", "gauge",
     "Time to create and register the staging arena.", lambda s: s.get("arena_setup_seconds")),
    ("cudasnap_restore_seconds", "gauge",
     "Duration of the last restore_latest().", lambda s: (s.get("restore") or {}).get("seconds")),
    ("cudasnap_restored_step", "gauge",
     "Step of the snapshot the last restore loaded.",
     lambda s: (s.get("restore") or {}).get("step")),
]


#: Bucket bounds (seconds): boundary() blocks for microseconds; a copy takes ms to seconds.
BOUNDARY_BUCKETS: tuple[float, ...] = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)
COPY_BUCKETS: tuple[float, ...] = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Hist:
    """A thread-safe cumulative histogram (observe is O(buckets), no allocation)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        i = 0
        while i < len(self.bounds) and v > self.bounds[i]:
            i += 1
        with self._lock:
            self.counts[i] += 1
            self.sum += v

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for bound, n in zip((*[repr(b) for b in self.bounds], "+Inf"), counts):
            acc += n
            out.append((bound, float(acc)))
        return out, total


class TimingHistograms:
    """Histograms of boundary() blocking time and snapshot copy time, in seconds.

    Fed by ``observe_boundary`` / ``observe_copy`` (one call per boundary / per
    completed copy); rendered as ``cudasnap_boundary_seconds`` and
    ``cudasnap_copy_seconds`` by :class:`SnapshotterCollector`.
    """

    def __init__(self, boundary_buckets: Sequence[float] = BOUNDARY_BUCKETS,
                 copy_buckets: Sequence[float] = COPY_BUCKETS) -> None:
        self.boundary = _Hist(boundary_buckets)
        self.copy = _Hist(copy_buckets)

    def observe_boundary(self, seconds: float) -> None:
        self.boundary.observe(seconds)

    def observe_copy(self, seconds: float) -> None:
        self.copy.observe(seconds)


def _number(v: Any) -> float | None:
    if v is None or isinstance(v, (str, bytes, dict, list, tuple)):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _check_labels(labels: Mapping[str, Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (labels or {}).items():
        if not isinstance(k, str) or not _LABEL_RE.match(k) or k.startswith("__"):
            raise ValueError(f"invalid Prometheus label name {k!r}")
        out[k] = str(v)
    return out


class SnapshotterCollector:
    """A ``prometheus_client`` collector: ``stats()`` of ``source`` read on each scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, Any] | None], labels: Mapping[str, Any] | None = None,
                 timings: TimingHistograms | None = None) -> None:
        _prom()
        self.stats = stats
        self.labels = _check_labels(labels)
        self.timings = timings

    def collect(self) -> Iterator[Any]:
        core = _prom().core
        s = self.stats() or {}
        names, values = list(self.labels), list(self.labels.values())
        for name, kind, help_text, get in _METRICS:
            try:
                value = _number(get(s))
            except Exception:  # noqa: BLE001 - a malformed entry never breaks a scrape
                value = None
            if value is None:
                continue
            if kind == "counter":
                fam: Any = core.CounterMetricFamily(name.removesuffix("_total"), help_text, labels=names)
            else:
                fam = core.GaugeMetricFamily(name, help_text, labels=names)
            fam.add_metric(values, value)
            yield fam
        if self.timings is not None:
            for name, help_text, hist in (
                    ("cudasnap_boundary_seconds", "Time boundary() blocked the training thread.",
                     self.timings.boundary),
                    ("cudasnap_copy_seconds", "Duration of each completed snapshot copy.", self.timings.copy)):
                buckets, total = hist.buckets()
                h = core.HistogramMetricFamily(name, help_text, labels=names)
                h.add_metric(values, buckets, total)
                yield h
        info = core.GaugeMetricFamily("cudasnap_info", "Snapshotter backend and last restore source (value 1).",
                                      labels=[*names, "backend", "restore_source"])
        info.add_metric([*values, str(s.get("backend") or "none"),
                         str((s.get("restore") or {}).get("source") or "none")], 1)
        yield info


def _render(collectors: Iterable[Any]) -> str:
    prom = _prom()
    registry = prom.CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return str(prom.generate_latest(registry).decode())


def prometheus_text(stats: Mapping[str, Any] | None, labels: Mapping[str, Any] | None = None,
                    timings: TimingHistograms | None = None) -> str:
    """``Snapshotter.stats()`` in the Prometheus text exposition format (version 0.0.4).

    Every metric carries ``labels`` (e.g. ``{"job": "x", "rank": 0}``); an
    info gauge ``cudasnap_info`` also names the backend and the last restore's
    source. Unknown values (None) are omitted.
    """
    return _render([SnapshotterCollector(lambda: stats, labels, timings)])


class MetricsServer:
    """A daemon HTTP server thread serving ``GET /metrics``; ``close()`` stops it."""

    def __init__(self, source: Any, port: int, host: str = "127.0.0.1",
                 labels: Mapping[str, Any] | None = None, timings: TimingHistograms | None = None) -> None:
        if not callable(getattr(source, "stats", None)):
            raise TypeError("serve_metrics needs an object with stats() (a Snapshotter or a "
                            "cudasnap integration callback)")
        prom = _prom()
        self.source = source
        self.timings = timings if timings is not None else TimingHistograms()
        self.collector = SnapshotterCollector(lambda: self.source.stats(), labels, self.timings)
        registry = prom.CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        metrics_app = prom.make_wsgi_app(registry, disable_compression=True)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO", "") not in ("/metrics", "/metrics/"):
                start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"not found: try /metrics\n"]
            environ = {**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}
            try:
                return list(metrics_app(environ, start_response))
            except Exception as e:  # noqa: BLE001 - report, keep serving
                log.warning("metrics scrape failed: %s", e)
                start_response("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")])
                return [f"error: {e}\n".encode()]

        class Quiet(WSGIRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("metrics: " + fmt, *args)

        self._server = make_server(host, port, app, prom.exposition.ThreadingWSGIServer, handler_class=Quiet)
        self.host, self.port = str(self._server.server_address[0]), int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="cudasnap-metrics", daemon=True)
        self._thread.start()
        log.info("cudasnap metrics on http://%s:%d/metrics", self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def serve_metrics(snapshotter: Any, port: int, host: str = "127.0.0.1",
                  labels: Mapping[str, Any] | None = None,
                  timings: TimingHistograms | None = None) -> MetricsServer:
    """Serves ``snapshotter.stats()`` at ``http://host:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port (see ``.port``). Binds to loopback by default;
    pass ``host="0.0.0.0"`` to let a Prometheus server on another host scrape.
    """
    return MetricsServer(snapshotter, port, host, labels, timings)


__all__ = ["prometheus_text", "serve_metrics", "MetricsServer", "SnapshotterCollector", "TimingHistograms",
           "CONTENT_TYPE"]
