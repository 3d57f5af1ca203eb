"""Errors raised by ``trainguard.elastic``.

One base, :class:`ElasticError`; each subclass also inherits what torch's elastic
agent and c10d expect to catch, so the agent's own handling still applies (a store
timeout is a ``DistStoreError``, a refused node leaves through torch's graceful exit,
a Redis that stays out of reach is a ``RendezvousConnectionError``, a job stopped
by a worker is a ``RendezvousClosedError``).
"""

from __future__ import annotations

from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
)

from trainguard.core.errors import TrainguardError

__all__ = [
    "ElasticConfigError",
    "ElasticError",
    "JobStoppedError",
    "NodeRefusedError",
    "RedisUnreachableError",
    "StoreTimeoutError",
]


class ElasticError(TrainguardError):
    """Base class of every error that ``trainguard.elastic`` raises on purpose."""


class StoreTimeoutError(ElasticError, DistStoreError):
    """A key of the Redis store did not appear within the store's timeout."""


class RedisUnreachableError(ElasticError, RendezvousConnectionError):
    """Redis stayed out of reach longer than the rendezvous waits for it."""


class NodeRefusedError(ElasticError, RendezvousGracefulExitError):
    """The admission check refused this node: its agent leaves the job, the others
    go on without it."""


class ElasticConfigError(ElasticError, RendezvousError, ValueError):
    """A ``--rdzv-conf`` option or endpoint the trainguard rendezvous cannot use."""


class JobStoppedError(ElasticError, RendezvousClosedError):
    """A worker stopped the job (the restart-loop breaker's exit 87): the rendezvous is
    closed and every agent exits instead of restarting its workers."""
