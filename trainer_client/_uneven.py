"""Ranks whose partitions hold different amounts of data, kept in step.

``TrainingSession.checkpoint`` (and any DDP all-reduce) is a collective: a rank that
leaves the loop while another still trains leaves the other waiting for it forever,
and a restart reaches the same step and hangs again. So ``session.batches()`` asks
every rank, at every step, whether it still has a batch (one small all-reduce, as
torch's ``Join`` does) and all ranks leave the loop in the same iteration:

- ``uneven="join"`` (default): a rank out of data keeps stepping on empty batches
  (``len(batch) == 0``, ``batch.data is None``) until every rank is out, so every
  record of every rank is trained once. The loop skips its work on an empty batch
  (or, under DDP, steps on a zero loss so the gradient all-reduce still matches).
- ``uneven="stop"``: every rank leaves as soon as one rank is out. No empty batch
  is ever yielded; the other ranks' remaining records stay unconsumed (the next run
  or pass reads them): nothing is lost, but this pass does not train them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer_client.dataset import Batch

__all__ = ["UNEVEN_MODES", "in_step"]

UNEVEN_MODES = ("join", "stop")


def _flag_device(group: Any) -> torch.device:
    # NCCL reduces only CUDA tensors; gloo and the rest take CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def in_step(source: Iterator[Batch], *, mode: str, group: Any) -> Iterator[Batch]:
    """``source``'s batches, every rank leaving in the same iteration (a collective
    per batch). A batch taken from ``source`` but not yielded (``stop``) is never
    recorded as consumed."""
    device = _flag_device(group)
    done = False
    while True:
        batch = None if done else next(source, None)
        done = batch is None
        flag = torch.tensor([0 if done else 1], dtype=torch.int32, device=device)
        op = dist.ReduceOp.SUM if mode == "join" else dist.ReduceOp.MIN
        dist.all_reduce(flag, op=op, group=group)
        if int(flag.item()) == 0:
            return
        yield batch if batch is not None else Batch(data=None, ids={}, offsets={})
