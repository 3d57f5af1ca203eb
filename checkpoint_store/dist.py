"""Rank coordination for saves and loads, over a dedicated gloo group.

Saves run their collectives in the background writer thread, so they must not share a
group with the training loop's own collectives: the store creates its own gloo group
(``torch.distributed.new_group``, itself a collective, so every rank of the default
group constructs its store together). Payloads are JSON or raw bytes sent as uint8
tensors; no pickle (``*_object`` collectives pickle, so they are not used).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Protocol

import torch

__all__ = ["ONE_PROCESS", "Comm", "GlooComm", "LocalComm", "all_gather_json", "broadcast_json",
           "gather_json", "make_comm"]


class Comm(Protocol):
    rank: int
    world_size: int

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""

    def all_gather_bytes(self, data: bytes) -> list[bytes]: ...

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0 (in rank order); None on the others."""

    def all_reduce_int64(self, values: list[int], op: str) -> list[int]:
        """The elementwise ``op`` ("sum" or "max") of every rank's ``values`` (all of
        one length), on every rank."""


class LocalComm:
    rank = 0
    world_size = 1

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        return [data]

    def all_reduce_int64(self, values: list[int], op: str) -> list[int]:
        return list(values)


class GlooComm:
    def __init__(self, group: Any):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if self.rank == 0 and data is not None else 0])
        self._dist.broadcast(size, src=self._src, group=self.group)
        if self.rank == 0:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            self._dist.broadcast(buf, src=self._src, group=self.group)
        return bytes(buf.numpy().tobytes())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        size = torch.tensor([len(data)])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        if longest:
            self._dist.all_gather(bufs, mine, group=self.group)
        return [bytes(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        # Sizes first (one int64 a rank, to rank 0 only), then the payloads padded to
        # the longest: the other ranks receive nothing.
        size = torch.tensor([len(data)])
        root = self.rank == 0
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)] \
            if root else None
        self._dist.gather(size, sizes, dst=self._src, group=self.group)
        longest = torch.tensor([max(int(s.item()) for s in sizes) if sizes else 0])
        self._dist.broadcast(longest, src=self._src, group=self.group)
        n = int(longest.item())
        mine = torch.zeros(n, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)] \
            if root else None
        if n:
            self._dist.gather(mine, bufs, dst=self._src, group=self.group)
        if sizes is None:
            return None
        if bufs is None or not n:
            return [b"" for _ in sizes]
        return [bytes(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]

    def all_reduce_int64(self, values: list[int], op: str) -> list[int]:
        if not values:
            return []
        ops = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}
        t = torch.tensor(values, dtype=torch.int64)
        self._dist.all_reduce(t, op=ops[op], group=self.group)
        return [int(v) for v in t.tolist()]


def broadcast_json(comm: Comm, doc: Any) -> Any:
    return json.loads(comm.broadcast_bytes(json.dumps(doc).encode() if comm.rank == 0 else None))


def all_gather_json(comm: Comm, doc: Any) -> list[Any]:
    if comm.world_size == 1:
        # Nothing to exchange. The JSON round trip of a save's report (an entry per
        # tensor) cost ~4 us per tensor; what ranks exchange is built from plain
        # str/int/list/dict values, so it reads the same either way.
        return [doc]
    return [json.loads(b) for b in comm.all_gather_bytes(json.dumps(doc).encode())]


def gather_json(comm: Comm, doc: Any) -> list[Any] | None:
    """Every rank's ``doc`` on rank 0; None on the others (which receive nothing)."""
    if comm.world_size == 1:
        return [doc]
    got = comm.gather_bytes(json.dumps(doc).encode())
    return None if got is None else [json.loads(b) for b in got]


ONE_PROCESS = "one-process"
"""As a store's ``process_group``: the store is this process's alone, whether
torch.distributed is initialized or not (a node's RAM tier in a multi-node job)."""


def make_comm(process_group: Any = None, *, timeout_s: float = 600.0) -> Comm:
    """A gloo group over ``process_group`` (default: the world), or a single-rank
    stand-in when torch.distributed is not initialized or ``process_group`` is
    :data:`ONE_PROCESS`."""
    import torch.distributed as dist

    if isinstance(process_group, str) and process_group == ONE_PROCESS:
        return LocalComm()

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialized")
        return LocalComm()
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    own = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
    if dist.get_world_size(own) == 1:
        return LocalComm()
    return GlooComm(own)
