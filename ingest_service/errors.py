"""Errors of the ingestion service: one base class, each also a matching built-in.

:class:`DatasetNotFoundError` is the stream contract's (one class for both sides),
re-exported here where the service raises it."""

from __future__ import annotations

from trainguard.core.errors import TrainguardError
from trainguard.core.streams import DatasetNotFoundError

__all__ = [
    "IngestError",
    "DatasetNotFoundError",
    "DatasetExistsError",
    "SourceError",
    "StreamLostError",
    "PushRejectedError",
    "MalformedPushError",
    "PushTooLargeError",
    "PushTooSlowError",
    "PushBusyError",
    "UnsupportedMediaError",
    "PushOutOfOrderError",
    "BatchMismatchError",
    "PushDataLostError",
    "BacklogFullError",
    "NotReplicatedError",
    "WrongDatasetKindError",
    "AdminError",
    "BadRequest",
    "NotFound",
    "Refused",
    "Unavailable",
    "Unauthorized",
    "Forbidden",
    "Misdirected",
    "TokenConfigError",
]


class IngestError(TrainguardError):
    """Base class of every error the ingestion service raises on purpose."""


class DatasetExistsError(IngestError, FileExistsError):
    """A dataset of that name exists with other settings."""

    def __init__(self, name: str, differences: dict[str, tuple[object, object]]):
        self.name = name
        self.differences = differences
        listed = "; ".join(f"{k}: existing {a!r}, requested {b!r}" for k, (a, b) in differences.items())
        super().__init__(
            f"dataset {name!r} already exists with other settings ({listed}): "
            "create it under another name, or delete it first"
        )


class SourceError(IngestError, OSError):
    """A source cannot be read at all (missing files, unknown format, missing extra)."""


class PushRejectedError(IngestError, ValueError):
    """A push request was rejected; ``status`` is the HTTP status to answer with (the
    client raises :class:`trainguard.push.PushRejectedError` for the same 4xx)."""

    status = 400


class MalformedPushError(PushRejectedError):
    """The push body or its parameters cannot be understood."""

    status = 400


class PushTooLargeError(PushRejectedError):
    """The push body or one of its records is over the size limit."""

    status = 413


class PushTooSlowError(PushRejectedError, TimeoutError):
    """The push body did not arrive within the read timeouts."""

    status = 408


class PushBusyError(PushRejectedError, BlockingIOError):
    """The service holds as many push bodies as its memory bound allows: retry."""

    status = 503


class UnsupportedMediaError(PushRejectedError):
    """The push body's content type is not one the service parses."""

    status = 415


class PushOutOfOrderError(PushRejectedError):
    """``seq`` is not the producer's next one (``mark + 1``, or 0 without a mark):
    ``mark`` is the producer's last wholly appended seq (None: it has none)."""

    status = 409

    def __init__(self, message: str, mark: int | None):
        super().__init__(message)
        self.mark = mark


class BatchMismatchError(PushRejectedError):
    """Another batch is partly appended under this ``seq``: the request's records are
    not that batch (their count or digest differs). Nothing was appended; the producer
    resends the batch it sent first, whole, under this seq."""

    status = 409

    def __init__(self, message: str, *, appended: int, count: int, digest: str):
        super().__init__(message)
        self.appended, self.count, self.digest = appended, count, digest


class PushDataLostError(PushRejectedError):
    """Redis no longer holds batches this service acknowledged (it restarted from an
    older snapshot, or without persistence): the producer's mark went back from
    ``acknowledged`` to ``mark``. The batches in between are lost."""

    status = 409

    def __init__(self, message: str, *, mark: int | None, acknowledged: int):
        super().__init__(message)
        self.mark, self.acknowledged = mark, acknowledged


class BacklogFullError(IngestError, BlockingIOError):
    """The partition's backlog is at its bound: retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReplicatedError(IngestError, TimeoutError):
    """A pushed batch reached the master, but not the replicas asked for in time: it is
    not acknowledged (503); the producer retries with the same seq."""


class WrongDatasetKindError(IngestError, TypeError):
    """The operation does not fit the dataset's format (e.g. a push to a file dataset)."""


# --------------------------------------------------------------------------- admin


class StreamLostError(IngestError):
    """Redis no longer holds what the producer wrote to a partition (a failover lost
    it, or the dataset was deleted): the producer syncs again from the source."""


class AdminError(IngestError):
    """Base of the errors the admin operations raise; ``code`` is the stable
    machine-readable name that the API puts in ``{"error": {"code": ...}}``."""

    status = 400

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class BadRequest(AdminError, ValueError):
    """The input is malformed (bad name, ID, partition or target)."""

    status = 400


class NotFound(AdminError, LookupError):
    """The dataset, group, store or checkpoint does not exist."""

    status = 404


class Refused(AdminError, PermissionError):
    """Well-formed, but not allowed in the current state (below floor, pinned...)."""

    status = 409


class TokenConfigError(AdminError, ValueError):
    """A configured token is blank, too short or malformed: the service will not start."""

    status = 500


class Unauthorized(AdminError, PermissionError):
    """No bearer token, or one this service does not know."""

    status = 401


class Forbidden(AdminError, PermissionError):
    """A known token, not allowed this (or no token configured for it at all)."""

    status = 403


class Misdirected(AdminError, PermissionError):
    """The request's Host is not a name this service answers to."""

    status = 421


class Unavailable(AdminError, ConnectionError):
    """A backend stayed out of reach past the operation's retries (503, retry later)."""

    status = 503
