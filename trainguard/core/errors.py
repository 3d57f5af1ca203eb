"""The root of every error trainguard raises on purpose.

Each package has its own base (``IngestError``, ``TrainerClientError``,
``CheckpointError``, ``ResilienceError``, the stream contract's ``ContractError``...),
and each of those derives from :class:`TrainguardError`, so a caller (the CLI's exit
code table, an application's top-level handler) can tell "trainguard refused or
failed, with a message that says why" from a bug with one ``isinstance``.
"""

from __future__ import annotations

__all__ = ["ContractError", "DatasetNotFoundError", "TrainguardError"]


class TrainguardError(Exception):
    """Base class of every error that a trainguard package raises on purpose."""


class ContractError(TrainguardError, ValueError):
    """A value does not follow the stream contract (bad name, ID or entry)."""


class DatasetNotFoundError(TrainguardError, LookupError):
    """The dataset has no metadata in Redis (never created, deleted, or lost with its
    Redis): :meth:`DatasetSpec.of_meta` for every side."""
