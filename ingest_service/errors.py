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
    "PushRejectedError",
    "MalformedPushError",
    "PushTooLargeError",
    "BacklogFullError",
    "NotReplicatedError",
    "WrongDatasetKindError",
    "AdminError",
    "BadRequest",
    "NotFound",
    "Refused",
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
    """A push request was refused; ``status`` is the HTTP status to answer with."""

    status = 400


class MalformedPushError(PushRejectedError):
    """The push body or its parameters cannot be understood."""

    status = 400


class PushTooLargeError(PushRejectedError):
    """The push body or one of its records is over the size limit."""

    status = 413


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
