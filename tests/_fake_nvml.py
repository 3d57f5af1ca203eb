"""The one allowed fake: an NVML module for machines without a GPU.

It has the same function names, constants and error classes as ``pynvml`` (the
error classes and constants *are* pynvml's, so ``except pynvml.NVMLError_...``
behaves as with the real library). Each GPU is a :class:`FakeGpu` whose readings a
test sets; ``errors`` maps an NVML function name to the exception it raises.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_used: int = 10 * 2**30
    memory_total: int = 80 * 2**30
    temperature_c: int = 60
    clocks_reasons: int = 0
    ecc_uncorrected: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_replay: int = 0
    pcie_tx_kb_s: int = 1000
    pcie_rx_kb_s: int = 2000
    errors: dict[str, BaseException] = field(default_factory=dict)


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_Unknown = pynvml.NVMLError_Unknown
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_PCIE_UTIL_TX_BYTES = pynvml.NVML_PCIE_UTIL_TX_BYTES
    NVML_PCIE_UTIL_RX_BYTES = pynvml.NVML_PCIE_UTIL_RX_BYTES
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: BaseException | None = None,
        new_clock_api: bool = True,
        old_clock_api: bool = True,
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.init_error = init_error
        self.initialized = 0
        self.shutdowns = 0
        self.calls: list[str] = []
        self.events: deque[SimpleNamespace] = deque()
        self.registered: set[int] = set()
        # pynvml < 12.535 has only the old name, newer ones have both: hide either.
        if not new_clock_api:
            self.nvmlDeviceGetCurrentClocksEventReasons = None  # type: ignore[assignment]
        if not old_clock_api:
            self.nvmlDeviceGetCurrentClocksThrottleReasons = None  # type: ignore[assignment]

    # -- test controls ---------------------------------------------------------------

    def emit_xid(self, index: int, xid: int) -> None:
        self.events.append(SimpleNamespace(
            device=index, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid))

    def _gpu(self, handle: int, fn: str) -> FakeGpu:
        self.calls.append(fn)
        gpu = self.gpus[handle]
        err = gpu.errors.get(fn)
        if err is not None:
            raise err
        return gpu

    # -- the NVML API ----------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._gpu(index, "nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        g = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=g.memory_used, total=g.memory_total,
                               free=g.memory_total - g.memory_used)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clocks_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clocks_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetPcieReplayCounter(self, handle: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        g = self._gpu(handle, "nvmlDeviceGetPcieThroughput")
        return g.pcie_tx_kb_s if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kb_s

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError and event_set == "event-set"
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        self.registered.add(handle)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if not self.events:
            raise pynvml.NVMLError_Timeout()
        return self.events.popleft()

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.calls.append("nvmlEventSetFree")
