"""What a restore may resume from: the session record of a checkpoint, checked
against this run (dataset, run, partition count), and the refusals rank 0 sends to
every rank."""

from __future__ import annotations

import logging

from trainer_client.errors import CheckpointMismatchError, PartitionCountError
from trainguard.core import record
from trainguard.core.checkpoints import ManifestView
from trainguard.core.record import SessionRecord

__all__ = ["REFUSALS", "check_record", "warn_if_reshaped"]

log = logging.getLogger("trainer_client.session")

REFUSALS: dict[str, type[Exception]] = {
    "CheckpointMismatchError": CheckpointMismatchError,
    "PartitionCountError": PartitionCountError,
    "LookupError": LookupError,
}


def check_record(manifest: ManifestView, *, dataset: str, run: str,
                 partitions: int) -> SessionRecord:
    """The session record of ``manifest``, or a clear error when this run cannot
    resume from it."""
    step = manifest.step
    try:
        rec = SessionRecord.of(manifest)
    except record.RecordError as exc:
        raise CheckpointMismatchError(f"checkpoint of step {step}: {exc}") from exc
    if rec is None:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} has no trainguard offsets in its manifest: "
            "expected one written by TrainingSession.checkpoint; use another store URL"
        )
    if rec.dataset != dataset or rec.run != run:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} belongs to dataset {rec.dataset!r} run "
            f"{rec.run!r}, expected dataset {dataset!r} run {run!r}: "
            "use a separate checkpoint URL per run"
        )
    if rec.partitions != partitions:
        raise PartitionCountError(
            f"checkpoint of step {step} was written for {rec.partitions} "
            f"partitions, dataset {dataset!r} now has {partitions}: "
            "its offsets cannot be mapped; recreate the dataset with the old count or "
            "start a new run"
        )
    return rec


def warn_if_reshaped(rec: SessionRecord | None, world_size: int, num_workers: int) -> None:
    if rec is not None and (rec.world_size, rec.num_workers) != (world_size, num_workers):
        log.warning(
            "deterministic mode resumes a checkpoint written with world_size=%s "
            "num_workers=%s on world_size=%s num_workers=%s: every record is still read "
            "once, but the batch order differs from an uninterrupted run's",
            rec.world_size, rec.num_workers, world_size, num_workers,
        )
