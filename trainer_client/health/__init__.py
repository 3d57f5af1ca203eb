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
from the checkpoint; ``trainguard probe --once`` uses the same code. With several
ranks the verdict travels in ``session.batches()``' per-step all-reduce: every rank
learns it at the same step boundary and checkpoints, the bad rank quarantines its
node and stops its torchrun agent (:mod:`trainer_client.health.leave`) before exiting
with 75, the others exit with :data:`EXIT_PEER_CRITICAL` (76) to rendezvous again
without it.

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

from trainer_client.health.exit import EXIT_GPU_CRITICAL, EXIT_PEER_CRITICAL, exit_if_not_handled
from trainer_client.health.monitor import HealthMonitor, NodeHealth
from trainer_client.health.probe import HealthProbe
from trainer_client.health.report import (
    CLOCKS_HW_POWER_BRAKE,
    CLOCKS_HW_SLOWDOWN,
    CLOCKS_HW_THERMAL,
    CLOCKS_SW_THERMAL,
    DEFAULT_CRITICAL_XIDS,
    Check,
    GpuReport,
    HealthReport,
    HealthThresholds,
    Status,
)

__all__ = [
    "CLOCKS_HW_POWER_BRAKE",
    "CLOCKS_HW_SLOWDOWN",
    "CLOCKS_HW_THERMAL",
    "CLOCKS_SW_THERMAL",
    "DEFAULT_CRITICAL_XIDS",
    "EXIT_GPU_CRITICAL",
    "EXIT_PEER_CRITICAL",
    "Check",
    "GpuReport",
    "HealthMonitor",
    "HealthProbe",
    "HealthReport",
    "HealthThresholds",
    "NodeHealth",
    "Status",
    "exit_if_not_handled",
]
