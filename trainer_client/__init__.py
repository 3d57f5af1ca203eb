"""What a training script imports: a streaming dataset over Redis partitions and a
session that restores, checkpoints and commits offsets so that every record trains
exactly once across crashes. Never imports aiohttp (tested)."""

from trainer_client.dataset import Batch, StreamingDataset
from trainer_client.errors import (
    CheckpointMismatchError,
    DatasetNotFoundError,
    FencedError,
    PartitionCountError,
    TrainerClientError,
)
from trainer_client.session import TrainingSession

__all__ = [
    "Batch",
    "CheckpointMismatchError",
    "DatasetNotFoundError",
    "FencedError",
    "PartitionCountError",
    "StreamingDataset",
    "TrainerClientError",
    "TrainingSession",
]
