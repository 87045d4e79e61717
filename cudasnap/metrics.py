"""Prometheus metrics for a Snapshotter: text exposition and a tiny /metrics server.

    from cudasnap.metrics import prometheus_text, serve_metrics
    text = prometheus_text(snap.stats(), labels={"job": "llm", "rank": "0"})
    server = serve_metrics(snap, port=9400)      # GET http://127.0.0.1:9400/metrics
    ...
    server.close()

Only the standard library; stats are read on each scrape (``stats()`` copies
counters, it never waits for a copy or a flush). Metric names follow the
Prometheus conventions (``cudasnap_`` prefix, ``_total`` for counters); a value
the Snapshotter does not know yet (no copy completed, no flush) is left out.
"""
from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("cudasnap.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# (metric name, type, help, function of the stats dict returning a number or None)
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


def _escape_label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _fmt_labels(labels: Mapping[str, Any]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"


def _fmt_value(v: Any) -> str | None:
    if v is None or isinstance(v, (str, bytes, dict, list, tuple)):
        return None
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return repr(f)


def _check_labels(labels: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (labels or {}).items():
        if not isinstance(k, str) or not _LABEL_RE.match(k) or k.startswith("__"):
            raise ValueError(f"invalid Prometheus label name {k!r}")
        out[k] = v
    return out


def prometheus_text(stats: Mapping[str, Any] | None, labels: Mapping[str, Any] | None = None) -> str:
    """``Snapshotter.stats()`` in the Prometheus text exposition format (version 0.0.4).

    Every metric carries ``labels`` (e.g. ``{"job": "x", "rank": 0}``); an
    info gauge ``cudasnap_info`` also names the backend and the last restore's
    source. Unknown values (None) are omitted.
    """
    lab = _check_labels(labels)
    s = stats or {}
    out: list[str] = []
    for name, kind, help_text, get in _METRICS:
        try:
            value = _fmt_value(get(s))
        except Exception:  # noqa: BLE001 - a malformed entry never breaks a scrape
            value = None
        if value is None:
            continue
        out.append(f"# HELP {name} {_escape_help(help_text)}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name}{_fmt_labels(lab)} {value}")
    info = dict(lab)
    info["backend"] = s.get("backend") or "none"
    info["restore_source"] = (s.get("restore") or {}).get("source") or "none"
    out.append("# HELP cudasnap_info Snapshotter backend and last restore source (value 1).")
    out.append("# TYPE cudasnap_info gauge")
    out.append(f"cudasnap_info{_fmt_labels(info)} 1")
    return "\n".join(out) + "\n"


class MetricsServer:
    """A daemon HTTP server thread serving ``GET /metrics``; ``close()`` stops it."""

    def __init__(self, source: Any, port: int, host: str = "127.0.0.1",
                 labels: Mapping[str, Any] | None = None) -> None:
        if not callable(getattr(source, "stats", None)):
            raise TypeError("serve_metrics needs an object with stats() (a Snapshotter or a "
                            "cudasnap integration callback)")
        self.labels = _check_labels(labels)
        self.source = source
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path not in ("/metrics", "/metrics/"):
                    self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics\n")
                    return
                try:
                    body = prometheus_text(outer.source.stats(), outer.labels).encode()
                except Exception as e:  # noqa: BLE001 - report, keep serving
                    log.warning("metrics scrape failed: %s", e)
                    self._send(500, "text/plain; charset=utf-8", f"error: {e}\n".encode())
                    return
                self._send(200, CONTENT_TYPE, body)

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("metrics: " + fmt, *args)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        addr = self._server.server_address
        self.host, self.port = str(addr[0]), int(addr[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={
            "poll_interval": 0.2}, name="cudasnap-metrics", daemon=True)
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
                  labels: Mapping[str, Any] | None = None) -> MetricsServer:
    """Serves ``snapshotter.stats()`` at ``http://host:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port (see ``.port``). Binds to loopback by default;
    pass ``host="0.0.0.0"`` to let a Prometheus server on another host scrape.
    """
    return MetricsServer(snapshotter, port, host, labels)


__all__ = ["prometheus_text", "serve_metrics", "MetricsServer", "CONTENT_TYPE"]
