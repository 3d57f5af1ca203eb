"""GPU health probes through NVML (``nvidia-ml-py``, import name ``pynvml``).

Per GPU, each probe reads these signals and judges each OK / WARN / CRITICAL with a
reason (thresholds in :class:`HealthThresholds`):

=========================  ===================================================  =========
signal                     source                                               default
=========================  ===================================================  =========
``memory``                 nvmlDeviceGetMemoryInfo: used / total                WARN >= 99%
``temperature``            nvmlDeviceGetTemperature (GPU core, deg C)           WARN >= 85, CRIT >= 95
``clocks_event_reasons``   nvmlDeviceGetCurrentClocksEventReasons (new name),   WARN on HW/thermal
                           else nvmlDeviceGetCurrentClocksThrottleReasons       slowdown bits
``ecc_uncorrected``        nvmlDeviceGetTotalEccErrors(uncorrected, volatile)   CRIT >= 1
``remapped_rows``          nvmlDeviceGetRemappedRows                            pending WARN, failed CRIT
``pcie_replay``            nvmlDeviceGetPcieReplayCounter, increase per probe   WARN >= 100
``pcie_throughput``        nvmlDeviceGetPcieThroughput TX/RX (KB/s)             value only
``xid``                    XID critical events (nvmlEventSet, drained per probe) CRIT for hardware XIDs
=========================  ===================================================  =========

Fail closed: any NVML error on a present GPU is CRITICAL, ``GpuIsLost`` included.
``NotSupported`` / ``FunctionNotFound`` mean the GPU or driver lacks that signal: it
is listed in ``skipped``, not judged. No NVML library, no driver or zero devices is
reported as ``no_gpu=True`` with status OK (a CPU node is healthy), unless
``expected_gpus`` says GPUs must be there. XID events are sticky: once a GPU showed a
critical XID it stays CRITICAL for the life of the probe (the node needs a reset).

Exit code: a trainer whose GPU turns CRITICAL checkpoints and exits with
:data:`EXIT_GPU_CRITICAL` (75, ``EX_TEMPFAIL`` in sysexits.h: "temporary failure,
retry later"), which tells the orchestrator to replace the node and restart the run
from the checkpoint; ``trainguard probe --once`` uses the same code.

:class:`HealthMonitor` probes in a background thread every ``interval_s``. Wire it
into the training loop with :meth:`HealthMonitor.check` between steps (raises
:class:`~trainer_client.errors.GpuCriticalError`, whose ``exit_code`` is 75): then
the checkpoint is taken on the training thread, consistent with the step. The
optional ``on_critical`` callback runs once, on the monitor thread, at the first
CRITICAL report: use it for thread-safe reactions (log, alert), or pass
:func:`exit_if_not_handled` so that a loop stuck in a hung collective still ends
with exit code 75 after a grace period. Exceptions from callbacks are logged and do
not stop the monitor.

The NVML module is a constructor parameter so that tests without a GPU pass a fake.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from trainer_client.errors import GpuCriticalError

log = logging.getLogger(__name__)

__all__ = [
    "CLOCKS_HW_POWER_BRAKE",
    "CLOCKS_HW_SLOWDOWN",
    "CLOCKS_HW_THERMAL",
    "CLOCKS_SW_THERMAL",
    "DEFAULT_CRITICAL_XIDS",
    "EXIT_GPU_CRITICAL",
    "Check",
    "GpuReport",
    "HealthMonitor",
    "HealthProbe",
    "HealthReport",
    "HealthThresholds",
    "Status",
    "exit_if_not_handled",
]

EXIT_GPU_CRITICAL = 75
"""Process exit code after a CRITICAL GPU health report (sysexits EX_TEMPFAIL)."""

# Clocks-event (throttle) reason bits, identical under the old and new NVML names.
CLOCKS_HW_SLOWDOWN = 0x08
CLOCKS_SW_THERMAL = 0x20
CLOCKS_HW_THERMAL = 0x40
CLOCKS_HW_POWER_BRAKE = 0x80
_CLOCK_BIT_NAMES = {
    0x01: "gpu_idle", 0x02: "applications_clocks_setting", 0x04: "sw_power_cap",
    CLOCKS_HW_SLOWDOWN: "hw_slowdown", 0x10: "sync_boost", CLOCKS_SW_THERMAL: "sw_thermal",
    CLOCKS_HW_THERMAL: "hw_thermal", CLOCKS_HW_POWER_BRAKE: "hw_power_brake",
    0x100: "display_clock_setting",
}

DEFAULT_CRITICAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
"""XIDs that mean broken hardware (double-bit ECC, row remap failure, NVLink error,
fallen off the bus, GSP errors, ...). Other XIDs, often caused by the application
(13, 31, 43, 45), are WARN."""


class Status(enum.IntEnum):
    OK = 0
    WARN = 1
    CRITICAL = 2


@dataclass(frozen=True)
class HealthThresholds:
    memory_warn_fraction: float | None = 0.99
    memory_critical_fraction: float | None = None
    temperature_warn_c: float | None = 85.0
    temperature_critical_c: float | None = 95.0
    clocks_warn_mask: int = (
        CLOCKS_HW_SLOWDOWN | CLOCKS_SW_THERMAL | CLOCKS_HW_THERMAL | CLOCKS_HW_POWER_BRAKE
    )
    clocks_critical_mask: int = 0
    ecc_uncorrected_warn: int | None = None
    ecc_uncorrected_critical: int | None = 1
    remapped_rows_pending: Status = Status.WARN
    remapped_rows_failed: Status = Status.CRITICAL
    pcie_replay_warn_per_probe: int | None = 100
    pcie_replay_critical_per_probe: int | None = None
    critical_xids: frozenset[int] = DEFAULT_CRITICAL_XIDS
    expected_gpus: int | None = None
    """If set, fewer visible GPUs (or none) is CRITICAL instead of "no GPU"."""


@dataclass(frozen=True)
class Check:
    signal: str
    status: Status
    reason: str
    values: Mapping[str, float] = field(default_factory=dict)
    """Raw readings with units in the key, e.g. ``{"temperature_celsius": 71.0}``."""


@dataclass(frozen=True)
class GpuReport:
    index: int
    name: str
    uuid: str
    checks: tuple[Check, ...]
    skipped: tuple[str, ...] = ()

    @property
    def status(self) -> Status:
        return max((c.status for c in self.checks), default=Status.OK)


@dataclass(frozen=True)
class HealthReport:
    gpus: tuple[GpuReport, ...]
    no_gpu: bool = False
    checks: tuple[Check, ...] = ()
    """Node-level checks (NVML init, GPU count)."""
    taken_at: float = 0.0
    """time.time() of the probe."""

    @property
    def status(self) -> Status:
        return max(
            [c.status for c in self.checks] + [g.status for g in self.gpus], default=Status.OK
        )

    def problems(self) -> list[str]:
        """Every WARN/CRITICAL reason, prefixed with its GPU."""
        out = [f"{c.status.name}: {c.reason}" for c in self.checks if c.status]
        for g in self.gpus:
            out += [f"{c.status.name}: gpu {g.index}: {c.reason}" for c in g.checks if c.status]
        return out

    def to_dict(self) -> dict[str, Any]:
        def check(c: Check) -> dict[str, Any]:
            return {"signal": c.signal, "status": c.status.name, "reason": c.reason,
                    "values": dict(c.values)}

        return {
            "status": self.status.name,
            "no_gpu": self.no_gpu,
            "taken_at": self.taken_at,
            "checks": [check(c) for c in self.checks],
            "gpus": [
                {"index": g.index, "name": g.name, "uuid": g.uuid, "status": g.status.name,
                 "checks": [check(c) for c in g.checks], "skipped": list(g.skipped)}
                for g in self.gpus
            ],
        }


class _Skip(Exception):
    """The signal is not supported on this GPU or driver."""


def _worst(*pairs: tuple[bool, Status]) -> Status:
    return max((s for hit, s in pairs if hit), default=Status.OK)


class HealthProbe:
    """Reads and judges every signal of every GPU. Thread-safe; ``close()`` when done."""

    def __init__(
        self, thresholds: HealthThresholds | None = None, *, nvml: ModuleType | Any = None
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        self.thresholds = thresholds or HealthThresholds()
        self._lock = threading.Lock()
        self._initialized = False
        self._event_set: Any = None
        self._xid_registered: set[str] = set()  # GPU UUIDs whose XID events we receive
        self._xids: dict[str, list[int]] = {}  # GPU UUID -> XIDs seen (sticky)
        self._last_replay: dict[str, int] = {}

    def __enter__(self) -> HealthProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            if self._event_set is not None:
                try:
                    self.nvml.nvmlEventSetFree(self._event_set)
                except self.nvml.NVMLError:
                    pass  # shutting down: nothing left to protect
                self._event_set = None
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass
            self._initialized = False

    # -- probing ---------------------------------------------------------------------

    def probe(self) -> HealthReport:
        with self._lock:
            return self._probe()

    def _no_gpu(self, why: str) -> HealthReport:
        expected = self.thresholds.expected_gpus
        if expected:
            check = Check("gpu_count", Status.CRITICAL,
                          f"expected {expected} GPUs, found none: {why}", {"gpus": 0.0})
        else:
            check = Check("gpu_count", Status.OK, f"no GPU: {why}", {"gpus": 0.0})
        return HealthReport((), no_gpu=True, checks=(check,), taken_at=time.time())

    def _probe(self) -> HealthReport:
        nvml = self.nvml
        if not self._initialized:
            try:
                nvml.nvmlInit()
            except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded) as exc:
                return self._no_gpu(f"NVML unavailable ({exc})")
            except nvml.NVMLError as exc:
                check = Check("nvml_init", Status.CRITICAL, f"nvmlInit failed: {exc}")
                return HealthReport((), checks=(check,), taken_at=time.time())
            self._initialized = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            check = Check("gpu_count", Status.CRITICAL, f"nvmlDeviceGetCount failed: {exc}")
            return HealthReport((), checks=(check,), taken_at=time.time())
        if count == 0:
            return self._no_gpu("NVML sees 0 devices")
        node_checks = []
        expected = self.thresholds.expected_gpus
        if expected is not None:
            status = Status.CRITICAL if count < expected else Status.OK
            node_checks.append(Check("gpu_count", status,
                                     f"{count} GPUs visible, expected {expected}",
                                     {"gpus": float(count)}))
        gpus = tuple(self._probe_gpu(i) for i in range(count))
        return HealthReport(gpus, checks=tuple(node_checks), taken_at=time.time())

    def _probe_gpu(self, index: int) -> GpuReport:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(nvml.nvmlDeviceGetUUID(handle))
            name = str(nvml.nvmlDeviceGetName(handle))
        except nvml.NVMLError as exc:
            return GpuReport(index, "?", "?", (self._error_check("device", exc),))
        self._register_xid(handle, uuid)
        checks: list[Check] = []
        skipped: list[str] = []
        for signal, judge in self._signals():
            try:
                checks.append(judge(handle, uuid))
            except _Skip:
                skipped.append(signal)
            except nvml.NVMLError as exc:
                if isinstance(exc, nvml.NVMLError_NotSupported | nvml.NVMLError_FunctionNotFound):
                    skipped.append(signal)
                else:
                    checks.append(self._error_check(signal, exc))
                    if isinstance(exc, nvml.NVMLError_GpuIsLost):
                        # Every further read fails the same way; one verdict is enough.
                        return GpuReport(index, name, uuid, tuple(checks), tuple(skipped))
        if uuid not in self._xid_registered:
            skipped.append("xid")
        else:
            checks.append(self._judge_xid(uuid))
        return GpuReport(index, name, uuid, tuple(checks), tuple(skipped))

    def _error_check(self, signal: str, exc: BaseException) -> Check:
        if isinstance(exc, self.nvml.NVMLError_GpuIsLost):
            reason = "GPU is lost (fell off the bus or hung): the node needs a reset"
        else:
            reason = f"NVML error reading {signal}: {type(exc).__name__}: {exc}"
        return Check(signal, Status.CRITICAL, reason)

    def _signals(self) -> Iterator[tuple[str, Callable[[Any, str], Check]]]:
        yield "memory", self._memory
        yield "temperature", self._temperature
        yield "clocks_event_reasons", self._clocks
        yield "ecc_uncorrected", self._ecc
        yield "remapped_rows", self._remapped
        yield "pcie_replay", self._pcie_replay
        yield "pcie_throughput", self._pcie_throughput

    # -- one judge per signal --------------------------------------------------------

    def _memory(self, handle: Any, uuid: str) -> Check:
        t = self.thresholds
        info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
        used, total = float(info.used), float(info.total)
        frac = used / total if total else 0.0
        status = _worst(
            (t.memory_warn_fraction is not None and frac >= t.memory_warn_fraction, Status.WARN),
            (t.memory_critical_fraction is not None and frac >= t.memory_critical_fraction,
             Status.CRITICAL),
        )
        return Check("memory", status, f"memory {used / 2**30:.1f} of {total / 2**30:.1f} GiB "
                     f"used ({frac:.1%})",
                     {"memory_used_bytes": used, "memory_total_bytes": total})

    def _temperature(self, handle: Any, uuid: str) -> Check:
        t = self.thresholds
        temp = float(self.nvml.nvmlDeviceGetTemperature(handle, self.nvml.NVML_TEMPERATURE_GPU))
        status = _worst(
            (t.temperature_warn_c is not None and temp >= t.temperature_warn_c, Status.WARN),
            (t.temperature_critical_c is not None and temp >= t.temperature_critical_c,
             Status.CRITICAL),
        )
        limit = {Status.WARN: t.temperature_warn_c, Status.CRITICAL: t.temperature_critical_c}
        reason = f"temperature {temp:g} C" + (
            f" >= {status.name} threshold {limit[status]:g} C" if status else ""
        )
        return Check("temperature", status, reason, {"temperature_celsius": temp})

    def _clock_reasons(self, handle: Any) -> int:
        new = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if new is not None:
            try:
                return int(new(handle))
            except self.nvml.NVMLError_FunctionNotFound:
                pass  # driver older than the Python bindings: try the old entry point
        old = getattr(self.nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        if old is None:
            raise _Skip
        return int(old(handle))

    def _clocks(self, handle: Any, uuid: str) -> Check:
        t = self.thresholds
        mask = self._clock_reasons(handle)
        names = [n for bit, n in _CLOCK_BIT_NAMES.items() if mask & bit] or ["none"]
        status = _worst((bool(mask & t.clocks_warn_mask), Status.WARN),
                        (bool(mask & t.clocks_critical_mask), Status.CRITICAL))
        return Check("clocks_event_reasons", status,
                     f"clocks event reasons 0x{mask:x}: {', '.join(names)}",
                     {"clocks_event_reasons": float(mask)})

    def _ecc(self, handle: Any, uuid: str) -> Check:
        t, nvml = self.thresholds, self.nvml
        count = int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
        status = _worst(
            (t.ecc_uncorrected_warn is not None and count >= t.ecc_uncorrected_warn, Status.WARN),
            (t.ecc_uncorrected_critical is not None and count >= t.ecc_uncorrected_critical,
             Status.CRITICAL),
        )
        return Check("ecc_uncorrected", status,
                     f"{count} volatile uncorrected ECC errors since the last driver load",
                     {"ecc_uncorrected_volatile_errors": float(count)})

    def _remapped(self, handle: Any, uuid: str) -> Check:
        t = self.thresholds
        corr, unc, pending, failed = self.nvml.nvmlDeviceGetRemappedRows(handle)
        status = _worst((bool(pending), t.remapped_rows_pending),
                        (bool(failed), t.remapped_rows_failed))
        notes = ["remapping pending (reset the GPU)"] * bool(pending) + [
            "remapping failed (replace the GPU)"] * bool(failed)
        return Check("remapped_rows", status,
                     f"remapped rows: {corr} correctable, {unc} uncorrectable"
                     + (f"; {', '.join(notes)}" if notes else ""),
                     {"remapped_rows_correctable": float(corr),
                      "remapped_rows_uncorrectable": float(unc),
                      "remapped_rows_pending": float(bool(pending)),
                      "remapped_rows_failed": float(bool(failed))})

    def _pcie_replay(self, handle: Any, uuid: str) -> Check:
        t = self.thresholds
        total = int(self.nvml.nvmlDeviceGetPcieReplayCounter(handle))
        last = self._last_replay.get(uuid)
        self._last_replay[uuid] = total
        delta = 0 if last is None else max(0, total - last)
        status = _worst(
            (t.pcie_replay_warn_per_probe is not None and delta >= t.pcie_replay_warn_per_probe,
             Status.WARN),
            (t.pcie_replay_critical_per_probe is not None
             and delta >= t.pcie_replay_critical_per_probe, Status.CRITICAL),
        )
        return Check("pcie_replay", status,
                     f"PCIe replay counter {total} (+{delta} since the last probe)",
                     {"pcie_replay_count": float(total)})

    def _pcie_throughput(self, handle: Any, uuid: str) -> Check:
        nvml = self.nvml
        tx = float(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES))
        rx = float(nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES))
        return Check("pcie_throughput", Status.OK, f"PCIe TX {tx:g} KB/s, RX {rx:g} KB/s",
                     {"pcie_tx_bytes_per_second": tx * 1024, "pcie_rx_bytes_per_second": rx * 1024})

    # -- XID events ------------------------------------------------------------------

    def _register_xid(self, handle: Any, uuid: str) -> None:
        nvml = self.nvml
        if uuid in self._xid_registered:
            return
        try:
            if self._event_set is None:
                self._event_set = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                          self._event_set)
        except nvml.NVMLError:
            # Unsupported (or refused) on this GPU: the signal is reported as skipped,
            # and registration is tried again on the next probe.
            return
        self._xid_registered.add(uuid)

    def _drain_xids(self) -> None:
        nvml = self.nvml
        if self._event_set is None:
            return
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError_Timeout:
                return
            try:
                uuid = str(nvml.nvmlDeviceGetUUID(event.device))
            except nvml.NVMLError:
                uuid = "?"
            self._xids.setdefault(uuid, []).append(int(event.eventData))

    def _judge_xid(self, uuid: str) -> Check:
        try:
            self._drain_xids()
        except self.nvml.NVMLError as exc:
            return self._error_check("xid", exc)
        seen = self._xids.get(uuid, []) + self._xids.get("?", [])
        critical = [x for x in seen if x in self.thresholds.critical_xids]
        status = _worst((bool(seen), Status.WARN), (bool(critical), Status.CRITICAL))
        reason = f"XID events {seen}" + (f", hardware XIDs {critical}" if critical else "")
        return Check("xid", status, reason if seen else "no XID events",
                     {"xid_events": float(len(seen))})


def exit_if_not_handled(
    grace_s: float = 300.0, *, exit_fn: Callable[[int], object] = os._exit
) -> Callable[[HealthReport], None]:
    """An ``on_critical`` callback of last resort.

    It gives the training loop ``grace_s`` seconds to notice (:meth:`HealthMonitor.check`
    between steps), checkpoint and exit with :data:`EXIT_GPU_CRITICAL` itself. If the
    process is still alive then, the loop is stuck (typically in a collective on a dead
    GPU), and the process is ended with ``os._exit(EXIT_GPU_CRITICAL)``: no new
    checkpoint, the last committed one is restored on the replacement node.
    ``sys.exit`` would not do: on the monitor thread it only ends that thread.
    """

    def on_critical(report: HealthReport) -> None:
        log.critical("GPU health CRITICAL (%s); exiting with code %d in %.0f s unless the "
                     "training loop exits first", "; ".join(report.problems()),
                     EXIT_GPU_CRITICAL, grace_s)
        timer = threading.Timer(grace_s, exit_fn, args=(EXIT_GPU_CRITICAL,))
        timer.daemon = True
        timer.start()

    return on_critical


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
