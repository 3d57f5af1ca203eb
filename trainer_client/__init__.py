"""What a training script imports: a streaming dataset over Redis partitions and a
session that restores, checkpoints and commits offsets so that every record trains
exactly once across crashes.

Depends on the foundation (:mod:`trainguard.core`: the stream contract, the session
record, the checkpoint port, resilience) and never on ``checkpoint_store`` (a store is
passed in, or opened from a URL through the port) nor on aiohttp.
"""

from trainer_client.batch import Batch
from trainer_client.dataset import StreamingDataset
from trainer_client.errors import (
    AllRoutesFailedError,
    BatchGapError,
    CheckpointMismatchError,
    DatasetNotFoundError,
    EvictionRefusedError,
    FencedError,
    GpuCriticalError,
    LoaderPositionError,
    NoRollbackTargetError,
    PartitionCountError,
    RestartLoopError,
    RollbackLimitError,
    RouteRejectedError,
    SessionBypassedError,
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
from trainer_client.routes import HttpRoute, LocalRoute, RouteClient
from trainer_client.session import TrainingSession
from trainer_client.spikes import LossSpikeDetector, RollbackConfig, SpikeConfig, SpikeGuard
from trainer_client.watchdog import WatchdogConfig, init_process_group
from trainguard.core.exit_codes import EXIT_HUNG, EXIT_RESTART_LOOP
from trainguard.core.incidents import LoopPolicy
from trainguard.core.resilience import (
    BreakerState,
    CircuitBreaker,
    CircuitOpenError,
    Retrier,
    RetryPolicy,
    retry_testing,
)

__all__ = [
    "EXIT_GPU_CRITICAL",
    "EXIT_HUNG",
    "EXIT_RESTART_LOOP",
    "AllRoutesFailedError",
    "Batch",
    "BatchGapError",
    "BreakerState",
    "CheckpointMismatchError",
    "CircuitBreaker",
    "CircuitOpenError",
    "DatasetNotFoundError",
    "EvictionRefusedError",
    "FencedError",
    "GpuCriticalError",
    "GuardedTraining",
    "HealthMonitor",
    "HealthProbe",
    "HealthReport",
    "HealthThresholds",
    "HttpRoute",
    "LocalRoute",
    "LoaderPositionError",
    "LoopPolicy",
    "LossSpikeDetector",
    "NoRollbackTargetError",
    "PartitionCountError",
    "RestartLoopError",
    "Retrier",
    "RetryPolicy",
    "RollbackConfig",
    "RollbackLimitError",
    "RouteClient",
    "RouteRejectedError",
    "SessionBypassedError",
    "SpikeConfig",
    "SpikeGuard",
    "StreamingDataset",
    "TrainerClientError",
    "TrainingSession",
    "WatchdogConfig",
    "batch_id",
    "init_process_group",
    "retry_testing",
]
