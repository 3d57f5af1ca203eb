"""Batch IDs: a batch named by its records, ``"<partition>:<first ID>..<last ID>"`` per
partition, joined by ``;`` (stable across a replay that forms the same batches), and
whether two IDs share a record. Used by the spike guard's skips and the restart-loop
breaker's."""

from __future__ import annotations

from trainer_client.batch import Batch
from trainguard.core import streams

__all__ = ["batch_id", "overlaps"]

_Range = tuple[int, streams.StreamId, streams.StreamId]


def batch_id(batch: Batch) -> str:
    """The batch's records as ``"<p>:<first>..<last>"`` per partition, joined by ``;``.

    A batch's records of one partition are consecutive entries of that stream (one
    reader per partition and run), so first and last ID name them all."""
    if not batch.ids:
        raise ValueError("a batch without records has no ID (deterministic end marker?)")
    return ";".join(f"{p}:{ids[0]}..{ids[-1]}" for p, ids in sorted(batch.ids.items()))


def _ranges(bid: str) -> list[_Range]:
    out = []
    for part in bid.split(";"):
        p, _, span = part.partition(":")
        first, _, last = span.partition("..")
        out.append((int(p), streams.parse_id(first), streams.parse_id(last)))
    return out


def overlaps(a: str, b: str) -> bool:
    """Whether batch IDs ``a`` and ``b`` share a record (same partition, crossing spans)."""
    return any(pa == pb and fa <= lb and fb <= la
               for pa, fa, la in _ranges(a) for pb, fb, lb in _ranges(b))
