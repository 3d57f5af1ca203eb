"""Which saved bytes fill a requested block of a tensor: the resharding plan.

Pure arithmetic over the manifest's shard list, no I/O. A target block (a ``Shard``, a
DTensor's local shard, or a whole tensor) is filled from every saved block it
overlaps; of each, only the rows (first axis) the target needs are read, so a
resharded load reads its share and not the saved blocks whole. Saved blocks that
are identical (a replicated block recorded by several ranks) count once; blocks that
overlap otherwise, or leave a gap, make the checkpoint unusable for that block.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["Piece", "plan_region", "unique_blocks"]


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of array ``array`` hold the C-ordered block
    of global ``shape`` at global ``offsets`` (whole rows of one saved block)."""

    array: str
    offset: int
    nbytes: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def unique_blocks(shards: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The saved blocks with duplicates (same offsets and shape) dropped, first kept."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for s in shards:
        key = (tuple(s["offsets"]), tuple(s["shape"]))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def plan_region(shards: Iterable[Mapping[str, Any]], offsets: tuple[int, ...],
                shape: tuple[int, ...], *, where: str) -> list[Piece]:
    """The pieces that tile the block ``[offsets, offsets + shape)``; raises
    CorruptCheckpointError when the saved blocks do not tile it exactly once."""
    want = math.prod(shape)
    if want == 0:
        return []  # an empty block (an empty local shard) needs no bytes at all
    pieces: list[Piece] = []
    covered = 0
    for s in unique_blocks(shards):
        s_off, s_shape = tuple(s["offsets"]), tuple(s["shape"])
        volume = math.prod(s_shape)
        if volume == 0:
            continue
        lo = [max(a, b) for a, b in zip(offsets, s_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, s_off, s_shape)]
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            continue
        covered += math.prod(h - lo_ for lo_, h in zip(lo, hi))
        if not s_shape:  # a 0-d tensor is one element
            pieces.append(Piece(s["array"], int(s["offset"]), int(s["nbytes"]), (), ()))
            continue
        row_bytes = int(s["nbytes"]) // s_shape[0]
        first, last = lo[0] - s_off[0], hi[0] - s_off[0]
        pieces.append(Piece(
            s["array"], int(s["offset"]) + first * row_bytes, (last - first) * row_bytes,
            (lo[0], *s_off[1:]), (last - first, *s_shape[1:]),
        ))
    if covered != want:
        how = "overlap (a block was saved twice with different bounds)" if covered > want \
            else f"cover only {covered}"
        raise CorruptCheckpointError(
            f"{where}: the saved blocks {how} of the {want} elements requested at offsets "
            f"{offsets} with shape {shape}; the checkpoint cannot fill this block"
        )
    return pieces
