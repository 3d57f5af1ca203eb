"""``HealthProbe``: reads every NVML signal of every GPU and judges it (fail closed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from trainer_client.health.report import (
    CLOCK_BIT_NAMES,
    Check,
    GpuReport,
    HealthReport,
    HealthThresholds,
    Status,
)

__all__ = ["HealthProbe"]


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
        names = [n for bit, n in CLOCK_BIT_NAMES.items() if mask & bit] or ["none"]
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
