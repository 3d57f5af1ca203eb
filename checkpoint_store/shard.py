"""``Shard``: the slice of a global tensor that one rank owns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Shard", "Shards"]


@dataclass(frozen=True)
class Shard:
    """``tensor`` is the block ``[offsets[i] : offsets[i] + tensor.shape[i]]`` of a
    tensor of ``global_shape``. Save: each rank writes only its block. Load: the block
    is filled from whatever blocks the checkpoint holds (any other decomposition)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(x) for x in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(x) for x in self.offsets))
        local = tuple(self.tensor.shape)
        if not (len(local) == len(self.global_shape) == len(self.offsets)):
            raise ValueError(
                f"Shard needs tensor, global_shape and offsets of one rank; got shapes "
                f"{local}, {self.global_shape} and offsets {self.offsets}"
            )
        for o, n, g in zip(self.offsets, local, self.global_shape):
            if o < 0 or o + n > g:
                raise ValueError(
                    f"Shard block at offsets {self.offsets} with shape {local} does not "
                    f"fit in global shape {self.global_shape}"
                )


@dataclass(frozen=True)
class Shards:
    """Several blocks of one global tensor that this rank owns (a ``ShardedTensor``
    with several local shards, DCP's chunks of one tensor on one rank): saved as one
    tensor whose blocks are all of these, loaded by filling each block."""

    blocks: tuple[Shard, ...]

    def __post_init__(self) -> None:
        blocks = tuple(self.blocks)
        object.__setattr__(self, "blocks", blocks)
        if not blocks or not all(isinstance(b, Shard) for b in blocks):
            raise ValueError(f"Shards needs one or more Shard blocks, got {self.blocks!r}")
        first = blocks[0]
        for b in blocks[1:]:
            if b.global_shape != first.global_shape or b.tensor.dtype != first.tensor.dtype:
                raise ValueError(
                    f"the blocks of one Shards must share global shape and dtype; got "
                    f"{first.global_shape} {first.tensor.dtype} and {b.global_shape} "
                    f"{b.tensor.dtype}"
                )
