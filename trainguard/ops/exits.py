"""The one map from an exception to the ``trainguard`` command's exit code.

Every command's handler returns its code or raises; :func:`exit_code` turns what it
raised into a code and :func:`describe` into the one line printed on stderr. An
exception that is none of these (a bug) is not mapped: it propagates with its
traceback.

====  =====================================================================
code  meaning
====  =====================================================================
0     success
1     the operation failed (damaged checkpoint, Redis or storage failure,
      any other error trainguard raised on purpose)
2     bad usage or input (a value that does not parse or fit)
3     not found (dataset, group, store, checkpoint, file)
4     refused (conflict, not allowed: pinned, exists, fenced, active group,
      the node is quarantined)
75    GPU health CRITICAL: replace the node (sysexits ``EX_TEMPFAIL``)
76    (a trainer's, not the command's) another node's GPU turned CRITICAL: this
      node is fine, restart its worker without the bad node
86    a trainer hung: its watchdog saw no progress within its budget, dumped
      every thread's stack into the run's incident and exited so that the
      torchrun agent restarts the group (retryable)
87    restart loop: the same failure came back after every remedy of the
      restart-loop breaker; not retryable (every further restart by the agent
      exits 87 at once): read ``trainguard runs show RUN``
130   interrupted (Ctrl-C)
====  =====================================================================
"""

from __future__ import annotations

from trainguard.core import settings
from trainguard.core.checkpoints import CorruptCheckpointError
from trainguard.core.errors import TrainguardError
from trainguard.core.exit_codes import (
    EXIT_GPU_CRITICAL,
    EXIT_HUNG,
    EXIT_PEER_CRITICAL,
    EXIT_RESTART_LOOP,
)
from trainguard.core.urls import redact_text

__all__ = [
    "EPILOG",
    "EXIT_FAILED",
    "EXIT_GPU_CRITICAL",
    "EXIT_HUNG",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PEER_CRITICAL",
    "EXIT_REFUSED",
    "EXIT_RESTART_LOOP",
    "EXIT_USAGE",
    "describe",
    "exit_code",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED = 0, 1, 2, 3, 4
# The trainer's codes (75, 76, 86, 87) live in :mod:`trainguard.core.exit_codes`,
# which the trainer imports too; this module is where operators read them.
EXIT_INTERRUPTED = 130

_TABLE: tuple[tuple[tuple[type[BaseException], ...], int], ...] = (
    # Damaged data is a failure, though a CorruptCheckpointError is a ValueError too.
    ((CorruptCheckpointError,), EXIT_FAILED),
    ((LookupError, FileNotFoundError), EXIT_NOT_FOUND),
    ((PermissionError, FileExistsError), EXIT_REFUSED),
    ((ValueError,), EXIT_USAGE),
    ((TrainguardError, OSError), EXIT_FAILED),
)
"""First match wins. Each part's errors also inherit the built-in of their meaning
(``NotFound`` is a ``LookupError``, ``PinnedCheckpointError`` a ``PermissionError``),
which is what this table keys on; an error carrying its own ``exit_code`` (a CRITICAL
GPU: 75) is answered with that."""

EPILOG = """exit codes:
  0    success
  1    the operation failed (damaged checkpoint, Redis or storage failure)
  2    bad usage or input
  3    not found (dataset, group, store, checkpoint, file)
  4    refused (conflict or not allowed: pinned, exists, fenced, active group,
       the node is quarantined)
  75   GPU health CRITICAL: replace the node
  76   (a trainer's) another node's GPU was CRITICAL: restart without it
  86   a trainer hung (watchdog): the agent restarts it
  87   restart loop stopped by the breaker: not retryable, see `runs show`
  130  interrupted"""


def _redis_errors() -> tuple[type[BaseException], ...]:
    # Imported when an error is being mapped, never when the command line is built:
    # ``trainguard --version`` must not pay for a client library.
    try:
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - redis is a dependency
        return ()
    return (RedisError,)


def _credential_errors() -> tuple[type[BaseException], ...]:
    # botocore comes with the s3 extra only; looked up when an error is being mapped.
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:
        return ()
    return (NoCredentialsError, PartialCredentialsError)


NO_CREDENTIALS = (
    "expected S3 credentials for the store, found none: set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass --storage-options "
    "'{\"key\": ..., \"secret\": ...}', then run this again")


def exit_code(exc: BaseException) -> int | None:
    """The exit code for ``exc``, or None when it is not an expected failure."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    own = getattr(exc, "exit_code", None)
    if isinstance(own, int) and isinstance(exc, TrainguardError):
        return own
    for types, code in _TABLE:
        if isinstance(exc, types):
            return code
    if isinstance(exc, _redis_errors()):
        return EXIT_FAILED
    if isinstance(exc, _credential_errors()):
        return EXIT_USAGE
    return None





def describe(exc: BaseException, *, redis_url: str | None = None) -> str:
    """The line printed for ``exc``: its message, with a hint where one helps
    (``redis_url``: the Redis the command talked to)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, _redis_errors()):
        where = f"Redis at {redis_url}" if redis_url else "Redis"
        return redact_text(
            f"{where} failed ({type(exc).__name__}: {exc}); check that it runs and that "
            f"--redis-url / ${settings.REDIS_URL_ENV} points at it")
    if isinstance(exc, _credential_errors()):
        return NO_CREDENTIALS
    return redact_text(str(exc) or type(exc).__name__)
