"""Errors of the operations layer (the ``trainguard`` command and the demo): one base,
:class:`OpsError`, each class also the built-in of its meaning, which is what
:mod:`trainguard.ops.exits` maps to an exit code."""

from __future__ import annotations

from trainguard.core.errors import TrainguardError

__all__ = ["DemoError", "OpsError", "StoreNotFoundError", "StorePathError"]


class OpsError(TrainguardError):
    """Base of the errors the ``trainguard`` command and the demo raise themselves."""


class StoreNotFoundError(OpsError, FileNotFoundError):
    """The local store path does not exist (exit 3, never "no checkpoints")."""


class StorePathError(OpsError, ValueError):
    """The local store path is not a directory (exit 2)."""


class DemoError(OpsError, RuntimeError):
    """A step of the demo failed; the message says which and where its logs are."""
