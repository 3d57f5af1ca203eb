"""Errors raised by ``trainer_client``.

One base class, :class:`TrainerClientError`; each subclass also inherits the built-in
exception that matches its meaning, so callers that only know the built-ins still
catch it (``except ConnectionError`` catches every route failing).

Errors of the floors below are theirs, re-exported here where a trainer meets them:
:class:`DatasetNotFoundError` (the stream contract's) and, from ``trainer_client``,
``CircuitOpenError`` (resilience's).
"""

from __future__ import annotations

from collections.abc import Mapping

from trainguard.core.errors import TrainguardError
from trainguard.core.streams import DatasetNotFoundError

__all__ = [
    "AllRoutesFailedError",
    "BatchGapError",
    "CheckpointMismatchError",
    "DatasetNotFoundError",
    "EvictionRefusedError",
    "FencedError",
    "GpuCriticalError",
    "LoaderPositionError",
    "NoRollbackTargetError",
    "PartitionCountError",
    "PeerGpuCriticalError",
    "RestartLoopError",
    "RollbackLimitError",
    "RouteRejectedError",
    "SessionBypassedError",
    "TrainerClientError",
]


class TrainerClientError(TrainguardError):
    """Base class of every error that ``trainer_client`` raises on purpose."""


class RollbackLimitError(TrainerClientError, RuntimeError):
    """Loss spikes forced more rollbacks than the policy allows in its step window."""


class NoRollbackTargetError(RollbackLimitError, LookupError):
    """A loss spike needs a rollback, but no committed checkpoint of the current
    lineage was taken before it. A :class:`RollbackLimitError` too, so a handler of
    "training cannot go on after a spike" catches both."""


class GpuCriticalError(TrainerClientError, RuntimeError):
    """A GPU health probe reported CRITICAL; ``report`` holds the full result.

    The process should checkpoint and exit with ``exit_code``
    (:data:`trainer_client.health.EXIT_GPU_CRITICAL`) so the orchestrator replaces
    the node.
    """

    def __init__(self, message: str, *, report: object, exit_code: int) -> None:
        super().__init__(message)
        self.report = report
        self.exit_code = exit_code


class RestartLoopError(TrainerClientError, RuntimeError):
    """The same failure came back after every remedy the restart-loop breaker tried
    (or the breaker already stopped this run and the agent restarted it). Not
    retryable: the process exits with ``exit_code``
    (:data:`trainguard.core.exit_codes.EXIT_RESTART_LOOP`, 87); the run's last
    incident says what was tried and where to look."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
class PeerGpuCriticalError(GpuCriticalError):
    """Another rank's GPU reported CRITICAL at this step boundary; this rank's is fine.

    Raised on the healthy ranks in the same iteration as the bad rank's
    :class:`GpuCriticalError`, so that all of them checkpoint together. Its
    ``exit_code`` (:data:`trainer_client.health.EXIT_PEER_CRITICAL`) asks this node's
    torchrun agent to restart the worker and rendezvous again without the bad node;
    ``ranks`` is how many ranks reported CRITICAL.
    """

    def __init__(self, message: str, *, ranks: int, exit_code: int) -> None:
        super().__init__(message, report=None, exit_code=exit_code)
        self.ranks = ranks


class RouteRejectedError(TrainerClientError, ValueError):
    """A route answered, but refused the request itself (HTTP 4xx other than 408/429).

    Not a route failure: every other route would refuse the same request, so the
    client raises at once instead of falling back. Fix the request.
    """

    def __init__(self, route: str, status: int, body: str) -> None:
        self.route = route
        self.status = status
        self.body = body
        super().__init__(
            f"route {route!r} rejected the request with HTTP {status} (expected 2xx): "
            f"{body[:200]!r}. The request is malformed for this service; fix it "
            "rather than retrying."
        )


class AllRoutesFailedError(TrainerClientError, ConnectionError):
    """Every route of a :class:`trainer_client.routes.RouteClient` failed or was open.

    ``failures`` maps each route name, in order, to the exception it gave.
    """

    def __init__(self, client: str, failures: Mapping[str, BaseException]) -> None:
        self.client = client
        self.failures = dict(failures)
        lines = "; ".join(
            f"{route}: {type(exc).__name__}: {exc}" for route, exc in self.failures.items()
        )
        super().__init__(
            f"all {len(self.failures)} routes of {client!r} failed ({lines}). Expected at "
            "least one route to answer; check the services, or add a local fallback route."
        )


# --------------------------------------------------------------------------- streams, offsets


class CheckpointMismatchError(TrainerClientError, ValueError):
    """The run's newest checkpoint was written for another dataset (or another run)."""


class PartitionCountError(TrainerClientError, ValueError):
    """The dataset's partition count differs from the one in the run's checkpoint:
    the saved offsets cannot be mapped onto the partitions any more."""


class SessionBypassedError(TrainerClientError, RuntimeError):
    """The training loop read a session's dataset without ``session.batches()``: the
    session cannot know what was consumed, so it refuses to read or checkpoint
    rather than commit offsets that would make a restart train records twice."""


class LoaderPositionError(TrainerClientError, ValueError):
    """A loader that keeps its own position (torchdata's ``StatefulDataLoader``, or one
    given a position with ``load_state_dict``) was put in the checkpointed state or
    handed to ``session.batches``: on resume it would skip what it had yielded, on top
    of the session's offsets, and those records would never be trained."""


class BatchGapError(TrainerClientError, RuntimeError):
    """Deterministic mode: a loader worker's batches skipped one (or repeated one), so
    the worker-order merge cannot go on without losing or repeating records."""


class FencedError(TrainerClientError, PermissionError):
    """A newer trainer of the same run restored (higher fencing generation): this one
    is a zombie and may no longer read, acknowledge or commit. Stop this process."""

    def __init__(self, *, group: str, mine: int, current: int, what: str) -> None:
        self.group = group
        self.mine = mine
        self.current = current
        super().__init__(
            f"{what} refused for run {group!r}: this trainer holds fencing generation "
            f"{mine}, expected it to be the newest, but generation {current} has restored "
            "since. Another trainer of this run took over; stop this process."
        )


class EvictionRefusedError(TrainerClientError, PermissionError):
    """A restore could not close the reading connections of older generations: the
    Redis user may not run CLIENT LIST or CLIENT KILL. Without that, a zombie trainer's
    open connections could keep reading after the restore."""

    def __init__(self, *, node: str, group: str, refusal: str) -> None:
        self.node = node
        super().__init__(
            f"restore of run {group!r} needs CLIENT LIST and CLIENT KILL on every Redis "
            f"server, to close the reading connections of older trainers of the run; "
            f"{node} refused: {refusal}. Grant them to the trainer's Redis user "
            "(ACL SETUSER <user> +client|list +client|kill), then restore again. The "
            "fences are already written: older trainers are refused on every new "
            "connection."
        )
