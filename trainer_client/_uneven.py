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

The same all-reduce carries the GPU health verdict: each rank adds 1 when its health
monitor has seen a CRITICAL report. A rank that raised on its own report between
steps would leave the others waiting in the next collective (the checkpoint it means
to take is one); instead every rank learns the count at the same step boundary and
raises in the same iteration, the bad ranks :class:`GpuCriticalError`, the healthy
ones :class:`PeerGpuCriticalError`, and all of them checkpoint together
(``GuardedTraining.exit_on_gpu_critical``). The batch taken in that iteration is not
yielded, so it is not recorded as consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from trainer_client.batch import Batch
from trainer_client.errors import PeerGpuCriticalError
from trainer_client.health import EXIT_PEER_CRITICAL, HealthMonitor

__all__ = ["UNEVEN_MODES", "Uneven", "flag_device", "in_step"]

Uneven = Literal["join", "stop"]
"""How ranks with different amounts of data leave the loop (module doc)."""
UNEVEN_MODES: tuple[Uneven, ...] = get_args(Uneven)


def flag_device(group: Any) -> torch.device:
    # NCCL reduces only CUDA tensors; gloo and the rest take CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def in_step(
    source: Iterator[Batch],
    *,
    mode: Uneven,
    group: Any,
    monitor: HealthMonitor | None = None,
) -> Iterator[Batch]:
    """``source``'s batches, every rank leaving in the same iteration (a collective
    per batch). A batch taken from ``source`` but not yielded (``stop``, a CRITICAL
    report) is never recorded as consumed. When any rank's ``monitor`` has seen a
    CRITICAL report, that rank raises its own GpuCriticalError (``monitor.check()``)
    and the others PeerGpuCriticalError, in the same iteration."""
    device = flag_device(group)
    world = dist.get_world_size(group)
    done = False
    while True:
        batch = None if done else next(source, None)
        done = batch is None
        bad = monitor is not None and monitor.critical is not None
        # One all-reduce for both answers: SUM of (has a batch, is CRITICAL); "stop"
        # (a MIN of the first) is "every rank has one".
        flags = torch.tensor([0 if done else 1, int(bad)], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
        have, criticals = (int(v) for v in flags.tolist())
        if criticals:
            if monitor is not None and bad:
                monitor.check()
            raise PeerGpuCriticalError(
                f"{criticals} of {world} ranks reported GPU health CRITICAL at this step "
                "boundary; this rank's GPU is fine. Checkpoint with every rank now, then "
                f"exit with code {EXIT_PEER_CRITICAL} so this node's agent rendezvous "
                "again without the bad node (it waits there until torchrun's --nnodes "
                "minimum of nodes joined; `trainguard nodes ls` shows the quarantined "
                "ones).", ranks=criticals, exit_code=EXIT_PEER_CRITICAL)
        if have == 0 or (mode == "stop" and have < world):
            return
        yield batch if batch is not None else Batch(data=None, ids={}, offsets={})
