"""The GPU health daemon's metrics: the contract between the daemon that writes them
(``trainguard probe``, :mod:`trainguard.ops.probe`) and the service that reads them
(:mod:`ingest_service.service.gpu_health`). A status is a number, ``STATUS_NAMES[n]``
its name (the ``Status`` of ``trainer_client.health``).

Names (per-GPU series are labelled ``gpu`` (index) and ``uuid``)::

    trainguard_node_health_status            0 OK, 1 WARN, 2 CRITICAL
    trainguard_node_no_gpu                   1 when no GPU / no NVML
    trainguard_node_gpus                     GPUs visible
    trainguard_health_probe_timestamp_seconds
    trainguard_gpu_check_status{signal=...}  0/1/2 per signal
    trainguard_gpu_<reading>                 e.g. trainguard_gpu_temperature_celsius
"""

from __future__ import annotations

__all__ = ["GPU_CHECK_STATUS", "GPU_LABELS", "GPU_PREFIX", "NODE_GPUS", "NODE_NO_GPU",
           "NODE_STATUS", "PROBE_TIMESTAMP", "SIGNAL_LABEL", "STATUS_NAMES", "gpu_reading"]

STATUS_NAMES = ("OK", "WARN", "CRITICAL")
NODE_STATUS = "trainguard_node_health_status"
NODE_NO_GPU = "trainguard_node_no_gpu"
NODE_GPUS = "trainguard_node_gpus"
PROBE_TIMESTAMP = "trainguard_health_probe_timestamp_seconds"
GPU_PREFIX = "trainguard_gpu_"
GPU_CHECK_STATUS = f"{GPU_PREFIX}check_status"
GPU_LABELS = ("gpu", "uuid")
SIGNAL_LABEL = "signal"


def gpu_reading(key: str) -> str:
    """The series of one NVML reading, e.g. ``temperature_celsius``."""
    return f"{GPU_PREFIX}{key}"
