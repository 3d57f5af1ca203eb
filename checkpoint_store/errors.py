"""The one exception hierarchy of ``checkpoint_store``.

Every error derives from :class:`CheckpointError`, and each subclass also inherits
the built-in that matches it, so ``except FileNotFoundError`` or ``except OSError``
keeps working for callers who do not know this package.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "DistributedSaveError",
    "NoCheckpointError",
    "PinnedCheckpointError",
    "SaveInProgressError",
    "StateMismatchError",
    "UnsupportedValueError",
]


class CheckpointError(Exception):
    """Base class of every error raised by ``checkpoint_store``."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored data does not match its checksum, or a record cannot be parsed."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No (valid) checkpoint matches the request."""


class SaveInProgressError(CheckpointError, RuntimeError):
    """A save is in flight and the caller asked not to wait (``if_busy="raise"``)."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (full disk, I/O error, permission); ``errno`` is kept.

    The previous checkpoint is untouched: nothing is published before the data is
    durable."""


class CommitConflictError(CheckpointError, FileExistsError):
    """The manifest name already exists: another writer committed the same record."""


class DistributedSaveError(CheckpointError, RuntimeError):
    """At least one rank failed its part of a save, so nothing was committed."""


class PinnedCheckpointError(CheckpointError, PermissionError):
    """The checkpoint is pinned; unpin it before deleting it."""


class StateMismatchError(CheckpointError, ValueError):
    """The state to load into does not match the checkpoint (keys, shapes or dtypes)."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be checkpointed; the message names its key path."""
