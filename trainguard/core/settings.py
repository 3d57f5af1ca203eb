"""The environment trainguard reads, in one place: each variable's name and default.

Every process (service, CLI, trainer, demo) resolves a setting the same way: an
explicit value (a flag, an argument) wins, then the environment variable, then the
default here. Nothing is read at import time, so a test or a launcher may set the
environment late.

============================== ============================= =======================
variable                       what                          default
============================== ============================= =======================
``TRAINGUARD_REDIS_URL``       the Redis every part talks to ``redis://127.0.0.1:6379/0``
                               (``redis+cluster://h:p,...``:
                               a Redis Cluster, see
                               ``trainguard.core.redis_url``)
``TRAINGUARD_ADMIN_TOKEN``     bearer token of mutating      unset: mutations refused
                               admin routes
``TRAINGUARD_CHECKPOINT_STORES`` checkpoint roots the admin  unset: none
                               API serves:
                               ``name=url[|remote_url],...``
``TRAINGUARD_PROBES``          GPU health daemons the        unset: none
                               dashboard reads:
                               ``node=http://host:port,...``
============================== ============================= =======================
"""

from __future__ import annotations

import os

__all__ = [
    "ADMIN_TOKEN_ENV",
    "CHECKPOINT_STORES_ENV",
    "DEFAULT_REDIS_URL",
    "PROBES_ENV",
    "REDIS_URL_ENV",
    "admin_token",
    "checkpoint_stores",
    "probes",
    "redis_url",
]

REDIS_URL_ENV = "TRAINGUARD_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_TOKEN_ENV = "TRAINGUARD_ADMIN_TOKEN"
CHECKPOINT_STORES_ENV = "TRAINGUARD_CHECKPOINT_STORES"
PROBES_ENV = "TRAINGUARD_PROBES"


def redis_url(explicit: str | None = None) -> str:
    """``explicit``, else ``$TRAINGUARD_REDIS_URL``, else :data:`DEFAULT_REDIS_URL`."""
    return explicit or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def admin_token() -> str | None:
    """``$TRAINGUARD_ADMIN_TOKEN``, or None when unset or empty."""
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def checkpoint_stores() -> str:
    """``$TRAINGUARD_CHECKPOINT_STORES`` as written (parsed by the admin API)."""
    return os.environ.get(CHECKPOINT_STORES_ENV, "")


def probes() -> str:
    """``$TRAINGUARD_PROBES`` as written: ``node=http://host:port,...``, the GPU health
    daemons (``trainguard probe``) whose metrics the dashboard shows."""
    return os.environ.get(PROBES_ENV, "")
