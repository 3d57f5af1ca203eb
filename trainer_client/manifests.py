"""What a ``TrainingSession`` writes into checkpoint manifests, and how it reads it back.

A manifest's ``extra["trainguard"]`` (the user's own ``extra`` keys sit beside it),
format version :data:`MANIFEST_VERSION`::

    version      1
    dataset      dataset name               run          the run (= consumer group)
    partitions   partition count            world_size   ranks that wrote it
    num_workers  DataLoader workers per rank of the pass it was taken in
    generation   fencing generation of the writer
    commit       the writer's commit counter
    offsets      {"<partition>": "<last consumed stream ID>"} for every partition
                 ("0-0": nothing consumed yet)
    batches      {"<partition>": <batches consumed from it>} (deterministic mode)

Restores pick the newest by ``(generation, commit, step)`` (:func:`restore_order`): a
rollback's lineage beats the higher steps it abandoned, and a newer generation beats
a zombie's late commit. The test ``test_fresh_run_reads_everything_and_final_
checkpoint_acks_all`` pins the exact document.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trainer_client.errors import CheckpointMismatchError, PartitionCountError
from trainguard import streams

__all__ = [
    "KEY",
    "MANIFEST_VERSION",
    "build",
    "check",
    "floor",
    "of",
    "restore_order",
]

KEY = "trainguard"
MANIFEST_VERSION = 1


def of(manifest: Any) -> dict[str, Any]:
    """The session's part of a manifest's extra (``{}`` when there is none)."""
    return dict((getattr(manifest, "extra", None) or {}).get(KEY) or {})


def build(
    *,
    dataset: str,
    run: str,
    partitions: int,
    generation: int,
    commit: int,
    world_size: int,
    num_workers: int,
    offsets: Mapping[int, str],
    batches: Mapping[int, int],
) -> dict[str, Any]:
    return {
        "version": MANIFEST_VERSION,
        "dataset": dataset,
        "run": run,
        "partitions": partitions,
        "generation": generation,
        "commit": commit,
        "world_size": world_size,
        "num_workers": num_workers,
        "offsets": streams.offsets_to_wire(offsets),
        "batches": {str(p): int(n) for p, n in sorted(batches.items())},
    }


def restore_order(manifest: Any) -> tuple[int, int, int]:
    tg = of(manifest)
    return int(tg.get("generation", 0)), int(tg.get("commit", 0)), int(manifest.step)


def check(manifest: Any, *, dataset: str, run: str, partitions: int) -> dict[str, Any]:
    """The session's part of ``manifest``, or a clear error when it cannot be used."""
    tg = of(manifest)
    step = manifest.step
    if not tg:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} has no trainguard offsets in its manifest: "
            "expected one written by TrainingSession.checkpoint; use another store URL"
        )
    if int(tg.get("version", 0)) > MANIFEST_VERSION:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} has trainguard manifest version {tg.get('version')}, "
            f"this trainer_client reads up to {MANIFEST_VERSION}: upgrade trainguard"
        )
    if tg.get("dataset") != dataset or tg.get("run") != run:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} belongs to dataset {tg.get('dataset')!r} run "
            f"{tg.get('run')!r}, expected dataset {dataset!r} run {run!r}: "
            "use a separate checkpoint URL per run"
        )
    if int(tg.get("partitions", -1)) != partitions:
        raise PartitionCountError(
            f"checkpoint of step {step} was written for {tg.get('partitions')} "
            f"partitions, dataset {dataset!r} now has {partitions}: "
            "its offsets cannot be mapped; recreate the dataset with the old count or "
            "start a new run"
        )
    return tg


def floor(newest: Mapping[int, str], kept: Iterable[Any], *, dataset: str, run: str) -> dict[int, str]:
    """Per partition, the smallest offset over ``newest`` and the kept checkpoints of
    this run: the producer may trim below it, never at or above."""
    out = dict(newest)
    for m in kept:
        tg = of(m)
        if tg.get("run") != run or tg.get("dataset") != dataset:
            continue
        for p, i in streams.offsets_from_wire(tg.get("offsets", {})).items():
            out[p] = streams.min_id(out.get(p), i) or i
    return out
