"""What a running producer has done, for progress displays (the CLI, the admin API)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ProducerProgress"]


@dataclass
class ProducerProgress:
    """What a running producer has done (this process only), for progress displays."""

    epoch: int = 0
    records: int = 0
    bytes: int = 0
    dead_letters: int = 0
    skipped: int = 0
    """Entries a retried batch found already there."""
    redis_losses: int = 0
    paused: set[int] = field(default_factory=set)
    epoch_records: int | None = None
    """Good records in one epoch of the dataset (every producer's partitions), once this
    producer has planned a whole epoch: the same in every epoch (the shuffle only
    reorders), so it makes the dataset's whole known."""
    finished: bool = False
    deleted: bool = False
