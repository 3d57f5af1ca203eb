"""Checks that turn silent misuse into a clear error or warning at checkpoint time.

- :func:`check_not_bypassed`: the loop read this rank's partitions (in this fencing
  generation) although no ``session.batches()`` pass ever ran: the session saw
  nothing consumed, so the checkpoint would commit the restored offsets, and a
  restart would train everything since then again.
- :func:`warn_divergent`: with several ranks, values that are not ``Shard`` blocks
  are saved from rank 0 only; a value that differs across ranks would be silently
  dropped, so it is named in a warning.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import redis
import torch
import torch.distributed as dist

from trainer_client._uneven import flag_device
from trainer_client.errors import SessionBypassedError
from trainguard.core import streams

__all__ = ["check_not_bypassed", "warn_divergent"]

log = logging.getLogger("trainer_client.session")

_SAMPLE = 4096
"""Elements of a tensor hashed to compare it across ranks: enough to tell values
apart, cheap on a large model (hashing every weight at each checkpoint is not)."""


def check_not_bypassed(client: redis.Redis, dataset: str, run: str,
                       offsets: Mapping[int, str]) -> None:
    """Raise :class:`SessionBypassedError` when the group delivered entries of these
    partitions past their consumed offsets (only called when no pass ran)."""
    pipe = client.pipeline(transaction=False)
    order = sorted(offsets)
    for p in order:
        pipe.xinfo_groups(streams.partition_key(dataset, p))
    for p, groups in zip(order, pipe.execute(raise_on_error=False)):
        if isinstance(groups, Exception):
            continue  # no stream yet: nothing was delivered
        for g in groups:
            if g.get("name") in (run, run.encode()):
                delivered = g.get("last-delivered-id")
                if delivered and streams.parse_id(delivered) > streams.parse_id(offsets[p]):
                    raise SessionBypassedError(
                        f"checkpoint refused: partition {p} delivered records up to "
                        f"{delivered.decode() if isinstance(delivered, bytes) else delivered} "
                        f"to this run, but the loop consumed none through session.batches() "
                        f"(consumed offset {offsets[p]}). Committing would make a restart "
                        "train them again. Iterate `session.batches(loader)`, not the loader"
                    )


def _is_shard(value: Any) -> bool:
    # checkpoint_store.Shard, known by its shape: trainer_client may not import it.
    return type(value).__name__ == "Shard" and hasattr(value, "global_shape")


def _digest(value: Any, h: Any) -> None:
    if _is_shard(value) or hasattr(value, "device_mesh"):
        return  # each rank saves its own block (Shard; DTensor's local shard)
    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1)[:_SAMPLE].cpu()
        h.update(f"T{tuple(value.shape)}{value.dtype}".encode())
        h.update(flat.contiguous().view(torch.uint8).numpy().tobytes()
                 if flat.numel() else b"")
        return
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            h.update(f"K{k!s}".encode())
            _digest(value[k], h)
        return
    if isinstance(value, list | tuple):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _digest(v, h)
        return
    state_dict = getattr(value, "state_dict", None)
    if callable(state_dict) and callable(getattr(value, "load_state_dict", None)):
        _digest(state_dict(), h)
        return
    h.update(repr(value).encode())


def warn_divergent(state: Mapping[str, Any], group: Any) -> list[str]:
    """The top-level keys of ``state`` whose non-Shard values differ from rank 0's
    (a collective; logged as a warning on rank 0). Returns them.

    No rank receives the others' digests: rank 0 broadcasts its own (one per key, not
    per rank), each rank flags the keys where it differs, and one MAX all-reduce of
    those flags (a fixed size: rank 0's keys + one for keys rank 0 lacks) tells every
    rank which keys differ somewhere. At 16,384 ranks an all-gather would carry every
    rank's digests into every rank at every checkpoint."""
    mine = {}
    for key in sorted(state, key=str):
        h = hashlib.blake2b(digest_size=16)
        _digest(state[key], h)
        mine[str(key)] = h.hexdigest()
    ref: list[Any] = [mine if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(ref, group=group, group_src=0)
    keys = sorted(ref[0])
    flags = torch.tensor([int(mine.get(k) != ref[0][k]) for k in keys]
                         + [int(not set(mine) <= set(keys))], dtype=torch.int64,
                         device=flag_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    differ = [k for k, f in zip(keys, flags.tolist()) if f]
    if flags[-1]:
        differ.append("(keys rank 0 does not have)")
    if differ and dist.get_rank(group) == 0:
        log.warning(
            "state keys %s differ across ranks but are not Shard blocks: only rank 0's "
            "values are saved, the other ranks' are dropped. Make them equal on every "
            "rank (e.g. all-reduce them), or save each rank's block as a "
            "checkpoint_store.Shard", differ,
        )
    return differ
