"""The GPU health node daemon behind ``trainguard probe``.

Probes every ``--interval-s`` seconds (see :mod:`trainer_client.health`) and serves::

    GET /metrics   prometheus text: per-GPU readings and check statuses, node status
    GET /healthz   200 unless the latest report is CRITICAL, then 503; JSON body

over the standard library's ``http.server`` (``trainer_client`` never imports
aiohttp). ``--once`` probes a single time, prints a table (or ``--json``) and exits
0 for OK and WARN (``--fail-on-warn``: WARN too exits 75), 75 for CRITICAL
(:data:`~trainer_client.health.EXIT_GPU_CRITICAL`, the code a trainer exits with on a
CRITICAL GPU). Binds to 127.0.0.1 unless told otherwise: the metrics describe the
node, expose them deliberately. ``--quarantine``: the first CRITICAL report writes the
node's quarantine record in Redis (:mod:`trainguard.core.quarantine`), so that its
gate (``trainguard node gate``) and a rendezvous admission refuse it.

The metric names are :mod:`trainguard.core.probe_metrics` (the service reads them
from there too).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trainer_client.health import (
    EXIT_GPU_CRITICAL,
    HealthMonitor,
    HealthProbe,
    HealthReport,
    HealthThresholds,
    Status,
)
from trainer_client.health.leave import quarantine_on_critical
from trainguard.core import probe_metrics as pm
from trainguard.core import settings

__all__ = ["ProbeServer", "exit_code_for", "format_table", "run_probe"]

class _ReportCollector(Collector):
    """Renders the monitor's latest report at scrape time, so a GPU that disappears
    leaves no stale series behind."""

    def __init__(self, monitor: HealthMonitor) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[Metric]:
        report = self._monitor.latest
        if report is None:
            return
        node = [
            (pm.NODE_STATUS, "Worst check status: 0 OK, 1 WARN, 2 CRITICAL.",
             float(report.status)),
            (pm.NODE_NO_GPU, "1 when the node has no GPU (or no NVML).", float(report.no_gpu)),
            (pm.NODE_GPUS, "GPUs visible to NVML.", float(len(report.gpus))),
            (pm.PROBE_TIMESTAMP, "Unix time of the latest probe.", report.taken_at),
        ]
        for name, doc, value in node:
            yield GaugeMetricFamily(name, doc, value=value)
        status = GaugeMetricFamily(pm.GPU_CHECK_STATUS,
                                   "Per-GPU check status: 0 OK, 1 WARN, 2 CRITICAL.",
                                   labels=[*pm.GPU_LABELS, pm.SIGNAL_LABEL])
        readings: dict[str, GaugeMetricFamily] = {}
        for gpu in report.gpus:
            labels = [str(gpu.index), gpu.uuid]
            for check in gpu.checks:
                status.add_metric([*labels, check.signal], float(check.status))
                for key, value in check.values.items():
                    family = readings.get(key)
                    if family is None:
                        family = readings[key] = GaugeMetricFamily(
                            pm.gpu_reading(key), f"GPU reading {key} (from NVML).",
                            labels=list(pm.GPU_LABELS))
                    family.add_metric(labels, value)
        yield status
        yield from readings.values()


class ProbeServer:
    """The daemon's HTTP side: ``/metrics`` and ``/healthz`` for one monitor."""

    def __init__(self, monitor: HealthMonitor, host: str = "127.0.0.1", port: int = 0) -> None:
        self.monitor = monitor
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ReportCollector(monitor))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would flood stderr

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(req, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            report = self.monitor.latest
            body: dict[str, Any]
            if report is None:
                body = {"status": "UNKNOWN", "problems": ["no probe has finished yet"]}
                code = 503
            else:
                body = {"status": report.status.name, "no_gpu": report.no_gpu,
                        "problems": report.problems()}
                code = 503 if report.status is Status.CRITICAL else 200
            self._send(req, code, json.dumps(body).encode(), "application/json")
        else:
            self._send(req, 404, b'{"error": "not found: try /metrics or /healthz"}',
                       "application/json")

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str) -> None:
        req.send_response(code)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def start(self) -> ProbeServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="trainguard-probe-http")
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(10)


def exit_code_for(report: HealthReport, *, fail_on_warn: bool = False) -> int:
    worst = Status.WARN if fail_on_warn else Status.CRITICAL
    return EXIT_GPU_CRITICAL if report.status >= worst else 0


def format_table(report: HealthReport) -> str:
    rows = [("GPU", "STATUS", "SIGNAL", "DETAIL")]
    for c in report.checks:
        rows.append(("node", c.status.name, c.signal, c.reason))
    for g in report.gpus:
        rows.append((str(g.index), g.status.name, "device", f"{g.name} {g.uuid}"))
        rows += [(str(g.index), c.status.name, c.signal, c.reason) for c in g.checks]
        if g.skipped:
            rows.append((str(g.index), "-", "skipped", ", ".join(g.skipped)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    lines.append(f"overall: {report.status.name}" + (" (no GPU)" if report.no_gpu else ""))
    return "\n".join(lines)


def run_probe(args: argparse.Namespace) -> int:
    """``trainguard probe``: one probe (``--once``) or the daemon until SIGTERM."""
    overrides = {k: getattr(args, k) for k in ("temperature_warn_c", "temperature_critical_c")
                 if getattr(args, k) is not None}
    thresholds = HealthThresholds(expected_gpus=args.expected_gpus, **overrides)
    probe = HealthProbe(thresholds)
    try:
        if args.once:
            report = probe.probe()
            print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
            return exit_code_for(report, fail_on_warn=args.fail_on_warn)
        on_critical = None
        if args.quarantine:
            on_critical = quarantine_on_critical(settings.redis_url(args.redis_url),
                                                 node=args.node)
        monitor = HealthMonitor(probe, interval_s=args.interval_s, on_critical=on_critical)
        monitor.probe_now()  # serve a real report from the first request on
        server = ProbeServer(monitor, args.host, args.port)
        monitor.start()
        stopped = threading.Event()

        def on_sigterm(signum: int, frame: object) -> None:
            stopped.set()

        signal.signal(signal.SIGTERM, on_sigterm)
        server.start()
        print(f"trainguard probe: serving {server.url}/metrics and {server.url}/healthz",
              file=sys.stderr, flush=True)
        try:
            while not stopped.wait(0.5):
                pass
        finally:
            server.stop()
            monitor.stop()
        return 0
    finally:
        probe.close()
