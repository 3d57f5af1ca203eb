"""``HealthMonitor``: probes in a background thread; the loop checks it between steps.
``NodeHealth``: "how is this node now", for a session or a guard that may or may not
run a monitor."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from trainer_client.errors import GpuCriticalError
from trainer_client.health.exit import EXIT_GPU_CRITICAL
from trainer_client.health.probe import HealthProbe
from trainer_client.health.report import Check, HealthReport, Status

__all__ = ["HealthMonitor", "NodeHealth"]

log = logging.getLogger("trainer_client.health")


class HealthMonitor:
    """Probes in a daemon thread every ``interval_s``; see the module docstring."""

    def __init__(
        self,
        probe: HealthProbe,
        *,
        interval_s: float = 30.0,
        on_critical: Callable[[HealthReport], None] | None = None,
        on_report: Callable[[HealthReport], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.probe = probe
        self.interval_s = interval_s
        self._on_critical = on_critical
        self._on_report = on_report
        self._lock = threading.Lock()
        self._latest: HealthReport | None = None
        self._critical: HealthReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def latest(self) -> HealthReport | None:
        return self._latest

    @property
    def critical(self) -> HealthReport | None:
        """The first CRITICAL report, once there was one (sticky)."""
        return self._critical

    def probe_now(self) -> HealthReport:
        """Probe on the calling thread, record the result, and return it."""
        try:
            report = self.probe.probe()
        except Exception as exc:
            # A probe that crashes proves nothing about the GPUs: fail closed.
            report = HealthReport((), checks=(Check(
                "probe", Status.CRITICAL, f"health probe crashed: {type(exc).__name__}: {exc}"),),
                taken_at=time.time())
        fire = False
        with self._lock:
            self._latest = report
            if report.status is Status.CRITICAL and self._critical is None:
                self._critical = report
                fire = True
        for callback in (self._on_report, self._on_critical if fire else None):
            if callback is None:
                continue
            try:
                callback(report)
            except Exception:
                # A broken callback must not end the monitoring (nor the caller).
                log.exception("health monitor callback %r failed", callback)
        return report

    def check(self) -> None:
        """Raise GpuCriticalError if any probe so far was CRITICAL (call between steps)."""
        report = self._critical
        if report is not None:
            raise GpuCriticalError(
                "GPU health probe reported CRITICAL: " + "; ".join(report.problems())
                + f". Expected healthy GPUs; checkpoint now and exit with code "
                f"{EXIT_GPU_CRITICAL} so the orchestrator replaces this node.",
                report=report, exit_code=EXIT_GPU_CRITICAL,
            )

    def start(self) -> HealthMonitor:
        if self._thread is not None:
            raise RuntimeError("HealthMonitor already started")
        self._thread = threading.Thread(target=self._run, name="trainguard-health", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.probe_now()
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> HealthMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NodeHealth:
    """The latest report of ``monitor`` (probing now if it has none yet); without a
    monitor, a probe now, with the probe given or one made on first use (closed by
    :meth:`close`). A node without GPUs reports ``no_gpu=True``."""

    def __init__(self, monitor: HealthMonitor | None = None) -> None:
        self.monitor = monitor
        self._probe: HealthProbe | None = None

    def report(
        self, monitor: HealthMonitor | None = None, *, probe: HealthProbe | None = None
    ) -> HealthReport:
        monitor = monitor if monitor is not None else self.monitor
        if monitor is not None:
            return monitor.latest or monitor.probe_now()
        if probe is None:
            if self._probe is None:
                self._probe = HealthProbe()
            probe = self._probe
        return probe.probe()

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
