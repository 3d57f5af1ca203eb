"""What one rank writes: which Zarr arrays, and where each tensor's bytes go.

Pure data, computed before any I/O. Tensors of at least ``own_array_bytes`` (and at
least one axis) get an array of their own, with their real shape and dtype. Smaller
ones are packed, 64-byte aligned, into ``uint8`` arrays (``r<rank>/pack`` for whole
tensors, ``r<rank>/spack`` for blocks of sharded ones), so a state of thousands of small
tensors is a few chunk files, not thousands. The
store sets ``own_array_bytes`` to its chunk size: a tensor gets its own array once it
fills a chunk, so small arrays never multiply the files (and fsyncs) of a save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from checkpoint_store.dtypes import dtype_name, zarr_data_type
from checkpoint_store.flatten import TensorLeaf
from checkpoint_store.layout import rank_group
from checkpoint_store.zarr_format import ArrayLayout

__all__ = ["PACK_ALIGN", "Placement", "RankPlan", "plan_rank"]

PACK_ALIGN = 64


@dataclass(frozen=True)
class Placement:
    """Bytes of leaf ``leaf`` are ``[offset, offset + nbytes)`` of array ``array``."""

    leaf: int
    array: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RankPlan:
    rank: int
    arrays: tuple[ArrayLayout, ...]
    placements: tuple[Placement, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.placements)


def _align(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


def plan_rank(
    leaves: Sequence[TensorLeaf], *, rank: int, chunk_bytes: int, own_array_bytes: int
) -> RankPlan:
    group = rank_group(rank)
    arrays: list[ArrayLayout] = []
    placements: list[Placement] = []
    # Small blocks of sharded tensors get a pack of their own (``spack``): a rank
    # loading another layout reads the chunks it needs, and the unsharded values every
    # rank reads (optimizer steps, biases) never share a chunk with a shard's bytes.
    pack_ends: dict[str, int] = {}
    for i, leaf in enumerate(leaves):
        t = leaf.tensor
        nbytes = t.numel() * t.element_size()
        if t.dim() >= 1 and nbytes >= own_array_bytes:
            path = f"{group}/t{len(arrays)}"
            arrays.append(
                ArrayLayout.chunked(
                    path,
                    tuple(t.shape),
                    zarr_data_type(t.dtype),
                    t.element_size(),
                    target_chunk_bytes=chunk_bytes,
                    attributes={"torch_dtype": dtype_name(t.dtype), "key": leaf.path},
                )
            )
            placements.append(Placement(i, path, 0, nbytes))
        elif nbytes == 0:
            placements.append(Placement(i, "", 0, 0))  # empty tensors need no bytes
        else:
            pack_path = f"{group}/{'spack' if leaf.sharded else 'pack'}"
            end = pack_ends.get(pack_path, 0)
            offset = _align(end)
            placements.append(Placement(i, pack_path, offset, nbytes))
            pack_ends[pack_path] = offset + nbytes
    packs = [
        ArrayLayout.chunked(
            path, (end,), "uint8", 1,
            target_chunk_bytes=chunk_bytes, attributes={"packed": True},
            row_multiple=PACK_ALIGN,
        )
        for path, end in sorted(pack_ends.items())
    ]
    return RankPlan(rank, tuple(packs + arrays), tuple(placements))
