"""DTensor leaves (FSDP2 ``fully_shard``, tensor parallelism, ``distribute_tensor``).

A DTensor is stored like a set of ``Shard`` blocks: each rank contributes the block
its local shard holds (``to_local()``: byte handling never touches the DTensor, whose
ops may be collectives and whose uneven shards cannot be reshaped), at the offset the
placements give. On mesh dimensions where the tensor is replicated, only the replica
at coordinate 0 writes, so every byte is stored once. ``Partial`` (pending
reductions) and ``_StridedShard`` (blocks that are not boxes) are refused.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.core.checkpoints import UnsupportedValueError

__all__ = ["LocalBlock", "is_dtensor", "local_block"]

# torch.distributed.tensor is imported only when a DTensor is met: it costs most of
# this package's import time (0.5 s idle, seconds on a busy node), which every
# worker pays at each (re)start, and a value can only be a DTensor once that module
# is loaded, so its absence from sys.modules answers is_dtensor without importing it.
_DTENSOR_MODULE = "torch.distributed.tensor"


@dataclass(frozen=True)
class LocalBlock:
    """This rank's block of a DTensor: ``tensor`` sits at ``offsets`` in
    ``global_shape``; ``writes`` is False on a replica that leaves it to another
    rank; ``layout`` is what the manifest records (mesh shape and placements)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    writes: bool
    layout: dict[str, Any]


def is_dtensor(value: Any) -> bool:
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def _placement_name(p: Any, path: str) -> str:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard) or not isinstance(p, ShardPlacement | Replicate):
        raise UnsupportedValueError(
            f"cannot checkpoint the DTensor at {path!r}: placement {p} is not supported "
            "(only Shard(dim) and Replicate); redistribute it first (for Partial: "
            "dt.redistribute(placements=[Replicate()]))"
        )
    return f"S({p.dim})" if isinstance(p, ShardPlacement) else "R"


@functools.lru_cache(maxsize=4096)
def _local_shape_and_offset(global_shape: tuple[int, ...], mesh: Any,
                            placements: tuple[Any, ...], coord: tuple[int, ...]
                            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block at mesh coordinate ``coord`` (this rank's: part of the key, so a mesh
    equal to an earlier one on another rank never reuses its answer). Cached: a
    model's state repeats a few shapes many times (each layer, each optimizer moment),
    and torch's computation was most of a save's blocked time outside the copy."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(shape), tuple(offsets)


def local_block(dt: Any, path: str) -> LocalBlock:
    """The local block of DTensor ``dt`` (any rank of its mesh, even an empty shard)."""
    names = [_placement_name(p, path) for p in dt.placements]
    mesh = dt.device_mesh
    global_shape = tuple(int(n) for n in dt.shape)
    local = dt.to_local()
    coord = mesh.get_coordinate()
    if coord is None:
        # This rank is outside the mesh: it holds nothing and writes nothing.
        empty = local.new_empty((0,) * len(global_shape))
        return LocalBlock(empty, global_shape, global_shape, False,
                          {"mesh_shape": list(mesh.shape), "placements": names})
    shape, offsets = _local_shape_and_offset(global_shape, mesh, tuple(dt.placements),
                                             tuple(coord))
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedValueError(
            f"cannot checkpoint the DTensor at {path!r}: its local shard has shape "
            f"{tuple(local.shape)}, its placements {names} give {tuple(shape)}"
        )
    # An empty block may report an offset past the end on its axis; pin it inside.
    offsets = tuple(min(int(o), g) for o, g in zip(offsets, global_shape))
    writes = all(c == 0 for c, n in zip(coord, names) if n == "R")
    return LocalBlock(local, global_shape, offsets, writes,
                      {"mesh_shape": list(mesh.shape), "placements": names})
