"""What a training script imports: a streaming dataset over Redis partitions and a
session that restores, checkpoints and commits offsets so that every record trains
exactly once across crashes. Never imports aiohttp (tested).

Names are resolved lazily (PEP 562): ``import trainer_client.breaker`` or the
``trainguard probe`` daemon do not pay for torch, and ``checkpoint_store`` may use
the breaker and retry helpers without an import cycle through the session.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "Batch": "trainer_client.dataset",
    "StreamingDataset": "trainer_client.dataset",
    "TrainingSession": "trainer_client.session",
    "TrainerClientError": "trainer_client.errors",
    "CheckpointMismatchError": "trainer_client.errors",
    "DatasetNotFoundError": "trainer_client.errors",
    "FencedError": "trainer_client.errors",
    "PartitionCountError": "trainer_client.errors",
    "CircuitOpenError": "trainer_client.errors",
    "RollbackLimitError": "trainer_client.errors",
    "NoRollbackTargetError": "trainer_client.errors",
    "GpuCriticalError": "trainer_client.errors",
    "RouteRejectedError": "trainer_client.errors",
    "AllRoutesFailedError": "trainer_client.errors",
    "CircuitBreaker": "trainer_client.breaker",
    "BreakerState": "trainer_client.breaker",
    "Retrier": "trainer_client.retry",
    "RetryPolicy": "trainer_client.retry",
    "retry_testing": "trainer_client.retry",
    "SpikeGuard": "trainer_client.spikes",
    "SpikeConfig": "trainer_client.spikes",
    "RollbackConfig": "trainer_client.spikes",
    "LossSpikeDetector": "trainer_client.spikes",
    "HealthProbe": "trainer_client.health",
    "HealthMonitor": "trainer_client.health",
    "HealthReport": "trainer_client.health",
    "HealthThresholds": "trainer_client.health",
    "EXIT_GPU_CRITICAL": "trainer_client.health",
    "GuardedTraining": "trainer_client.guard",
    "batch_id": "trainer_client.guard",
    "RouteClient": "trainer_client.routes",
    "HttpRoute": "trainer_client.routes",
    "LocalRoute": "trainer_client.routes",
}

__all__ = [
    "AllRoutesFailedError",
    "Batch",
    "BreakerState",
    "CheckpointMismatchError",
    "CircuitBreaker",
    "CircuitOpenError",
    "DatasetNotFoundError",
    "EXIT_GPU_CRITICAL",
    "FencedError",
    "GpuCriticalError",
    "GuardedTraining",
    "HealthMonitor",
    "HealthProbe",
    "HealthReport",
    "HealthThresholds",
    "HttpRoute",
    "LocalRoute",
    "LossSpikeDetector",
    "NoRollbackTargetError",
    "PartitionCountError",
    "Retrier",
    "RetryPolicy",
    "RollbackConfig",
    "RollbackLimitError",
    "RouteClient",
    "RouteRejectedError",
    "SpikeConfig",
    "SpikeGuard",
    "StreamingDataset",
    "TrainerClientError",
    "TrainingSession",
    "batch_id",
    "retry_testing",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from trainer_client.breaker import BreakerState, CircuitBreaker
    from trainer_client.dataset import Batch, StreamingDataset
    from trainer_client.errors import (
        AllRoutesFailedError,
        CheckpointMismatchError,
        CircuitOpenError,
        DatasetNotFoundError,
        FencedError,
        GpuCriticalError,
        NoRollbackTargetError,
        PartitionCountError,
        RollbackLimitError,
        RouteRejectedError,
        TrainerClientError,
    )
    from trainer_client.guard import GuardedTraining, batch_id
    from trainer_client.health import (
        EXIT_GPU_CRITICAL,
        HealthMonitor,
        HealthProbe,
        HealthReport,
        HealthThresholds,
    )
    from trainer_client.retry import Retrier, RetryPolicy, retry_testing
    from trainer_client.routes import HttpRoute, LocalRoute, RouteClient
    from trainer_client.session import TrainingSession
    from trainer_client.spikes import LossSpikeDetector, RollbackConfig, SpikeConfig, SpikeGuard
