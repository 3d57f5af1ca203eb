"""Several processes (Lightning DDP, the Hugging Face Trainer): what the integrations
add for more than one rank.

- :func:`save_on_every_rank`: Lightning's strategies call the ``CheckpointIO`` on rank 0
  only, but a session's checkpoint is a collective (every rank's offsets end in one
  manifest): the strategy of the run hands every rank's checkpoint to the plugin,
  which commits on all ranks and writes the marker on rank 0.
- :func:`in_step`: ranks whose partitions hold different amounts of data must still
  take the same number of steps (DDP's gradient all-reduce, the checkpoint collective).
  Every fetch asks all ranks whether they have a batch; while any has, a rank that is
  out gets an empty one (zero rows, shaped like its last batch) and trains an empty
  step; when none has, the epoch ends on every rank in the same step.
- :func:`same_on_every_rank`: rank 0's value of something every rank must agree on
  (a commit's id).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainguard.integrations._consumption import ConfirmedBatches

if TYPE_CHECKING:  # Hugging Face runs use this module without Lightning installed
    import lightning.pytorch as pl

__all__ = ["empty_like", "in_step", "same_on_every_rank", "save_on_every_rank"]


def _save(strategy: Any, checkpoint: dict[str, Any], filepath: Any,
          storage_options: Any | None = None) -> None:
    strategy.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


def save_on_every_rank(trainer: pl.Trainer) -> None:
    """Make ``trainer.strategy.save_checkpoint`` call the plugin on every rank (this
    strategy instance only: its ``remove_checkpoint`` stays on rank 0)."""
    strategy = trainer.strategy
    strategy.save_checkpoint = functools.partial(_save, strategy)  # type: ignore[method-assign]


def _flag(value: int) -> torch.Tensor:
    # NCCL reduces only CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.tensor([value], dtype=torch.int32,
                            device=torch.device("cuda", torch.cuda.current_device()))
    return torch.tensor([value], dtype=torch.int32)


def empty_like(data: Any) -> Any:
    # A fresh tensor, never a view: a view of a worker's batch would keep its
    # shared-memory slot alive.
    if isinstance(data, torch.Tensor):
        return data.new_empty((0, *data.shape[1:]))
    if isinstance(data, Mapping):  # a collated batch of dict records (Hugging Face)
        return {key: empty_like(value) for key, value in data.items()}
    return []


def in_step(batches: ConfirmedBatches, empty: Any = None) -> Iterator[Any]:
    """The batches' data, every rank ending in the same step (see the module).
    ``empty``: a rank's empty batch before it had one of its own to shape it on."""
    it = iter(batches)
    empty = torch.empty(0) if empty is None else empty
    while True:
        batch = next(it, None)
        flag = _flag(0 if batch is None else 1)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        if int(flag.item()) == 0:
            return
        if batch is None:
            batches.pad()
            yield empty
        else:
            empty = empty_like(batch.data)
            yield batch.data


def same_on_every_rank(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])
