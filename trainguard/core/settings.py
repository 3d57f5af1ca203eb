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
``TRAINGUARD_READ_TOKEN``      bearer token every read       unset: reads open
                               route needs (the admin token  (names and figures
                               passes too); shows private    only)
                               fields (manifest extra)
``TRAINGUARD_PUSH_TOKENS``     producer tokens of push,      unset: push refused
                               scoped to datasets and        (unless the service
                               producer_ids                  runs --insecure-local)
``TRAINGUARD_CHECKPOINT_STORES`` checkpoint roots the admin  unset: none
                               API serves:
                               ``name=url[|remote_url],...``
``TRAINGUARD_PROBES``          GPU health daemons the        unset: none
                               dashboard reads:
                               ``node=http://host:port,...``
``TRAINGUARD_NODE_ID``         this node's id in quarantine  the host name
                               records
``TRAINGUARD_QUARANTINE_S``    how long a quarantine holds   ``3600`` (0: never
                                                             quarantine)
``TRAINGUARD_QUARANTINE_FAILURES`` failures within the       ``3``
                               window that quarantine
``TRAINGUARD_QUARANTINE_WINDOW_S`` that window               ``600``
``TRAINGUARD_TOKENIZE_PROCESSES`` processes that tokenize    one per core beyond
                               text at ingest (0: in the     two, else 0
                               producer's own process)
``TRAINGUARD_WATCHDOG``        the trainer's hang watchdog:  on, with the defaults
                               ``off`` or ``key=value,...``  of ``WatchdogConfig``
                               (``trainer_client.watchdog``)
``TRAINGUARD_LOOP_BREAKER``    the restart-loop breaker:     on, ``max_tries=3``
                               ``off`` or ``max_tries=N``
``TRAINGUARD_RDZV_WORKER``     set by the trainguard         unset: torch's default
                               rendezvous for the workers    store, no job stop
                               it starts (JSON: its Redis,
                               run id, this round's store
                               prefix; see
                               ``trainguard.elastic.worker``)
``TRAINGUARD_WARM``            warm worker starts under the  on (``0``: every worker
                               wrapper                       starts cold, in the
                               ``trainguard.elastic.warm``   wrapper's process)
``TRAINGUARD_WARM_DIR``        where a node's zygote keeps   ``$XDG_RUNTIME_DIR/
                               its socket, lock and log      trainguard-warm``, else
                                                             ``/tmp/trainguard-warm-
                                                             <uid>``
``TRAINGUARD_WARM_PRELOAD``    modules the zygote imports    unset: torch,
                               beyond the defaults           torch.distributed,
                               (``a,b``)                     torch._dynamo,
                                                             trainer_client,
                                                             checkpoint_store
``TRAINGUARD_WARM_IDLE_S``     the zygote exits after this   ``600``
                               long without a worker
``TRAINGUARD_WARM_STARTED_AT`` set by the zygote in a        unset outside a warm
``TRAINGUARD_WARM_FORKED_AT``  worker it forks: the          worker
``TRAINGUARD_WARM_PID``        wrapper's start, the fork,
                               the worker's pid (its
                               incident phases, see
                               ``trainguard.core.process``)
============================== ============================= =======================
"""

from __future__ import annotations

import os
import socket

__all__ = [
    "ADMIN_TOKEN_ENV",
    "CHECKPOINT_STORES_ENV",
    "DEFAULT_REDIS_URL",
    "NODE_ID_ENV",
    "PROBES_ENV",
    "TIER_SERVERS_ENV",
    "PUSH_TOKENS_ENV",
    "QUARANTINE_ENVS",
    "READ_TOKEN_ENV",
    "REDIS_URL_ENV",
    "LOOP_BREAKER_ENV",
    "RDZV_WORKER_ENV",
    "TOKENIZE_PROCESSES_ENV",
    "WARM_DIR_ENV",
    "WARM_ENV",
    "WARM_FORKED_ENV",
    "WARM_IDLE_S_ENV",
    "WARM_PID_ENV",
    "WARM_PRELOAD_ENV",
    "WARM_STARTED_ENV",
    "WATCHDOG_ENV",
    "admin_token",
    "checkpoint_stores",
    "node_id",
    "probes",
    "tier_servers",
    "push_tokens",
    "quarantine",
    "read_token",
    "redis_url",
    "loop_breaker",
    "rdzv_worker",
    "tokenize_processes",
    "watchdog",
]

REDIS_URL_ENV = "TRAINGUARD_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ADMIN_TOKEN_ENV = "TRAINGUARD_ADMIN_TOKEN"
CHECKPOINT_STORES_ENV = "TRAINGUARD_CHECKPOINT_STORES"
PROBES_ENV = "TRAINGUARD_PROBES"
TIER_SERVERS_ENV = "TRAINGUARD_TIER_SERVERS"
PUSH_TOKENS_ENV = "TRAINGUARD_PUSH_TOKENS"
READ_TOKEN_ENV = "TRAINGUARD_READ_TOKEN"
TOKENIZE_PROCESSES_ENV = "TRAINGUARD_TOKENIZE_PROCESSES"
WATCHDOG_ENV = "TRAINGUARD_WATCHDOG"
LOOP_BREAKER_ENV = "TRAINGUARD_LOOP_BREAKER"
RDZV_WORKER_ENV = "TRAINGUARD_RDZV_WORKER"
NODE_ID_ENV = "TRAINGUARD_NODE_ID"
QUARANTINE_ENVS = ("TRAINGUARD_QUARANTINE_S", "TRAINGUARD_QUARANTINE_FAILURES",
                   "TRAINGUARD_QUARANTINE_WINDOW_S")
_QUARANTINE_DEFAULTS = (3600.0, 3, 600.0)
WARM_ENV = "TRAINGUARD_WARM"
WARM_DIR_ENV = "TRAINGUARD_WARM_DIR"
WARM_PRELOAD_ENV = "TRAINGUARD_WARM_PRELOAD"
WARM_IDLE_S_ENV = "TRAINGUARD_WARM_IDLE_S"
WARM_STARTED_ENV = "TRAINGUARD_WARM_STARTED_AT"
WARM_FORKED_ENV = "TRAINGUARD_WARM_FORKED_AT"
WARM_PID_ENV = "TRAINGUARD_WARM_PID"


def redis_url(explicit: str | None = None) -> str:
    """``explicit``, else ``$TRAINGUARD_REDIS_URL``, else :data:`DEFAULT_REDIS_URL`."""
    return explicit or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def admin_token() -> str | None:
    """``$TRAINGUARD_ADMIN_TOKEN``, or None when unset or empty."""
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def read_token() -> str | None:
    """``$TRAINGUARD_READ_TOKEN``, or None when unset or empty."""
    return os.environ.get(READ_TOKEN_ENV) or None


def checkpoint_stores() -> str:
    """``$TRAINGUARD_CHECKPOINT_STORES`` as written (parsed by the admin API)."""
    return os.environ.get(CHECKPOINT_STORES_ENV, "")


def tier_servers() -> str:
    """``$TRAINGUARD_TIER_SERVERS`` as written: ``store=<node>:<url> <url> ...,...``, the
    tier servers that say where a store root's checkpoints live (RAM, partners)."""
    return os.environ.get(TIER_SERVERS_ENV, "")


def probes() -> str:
    """``$TRAINGUARD_PROBES`` as written: ``node=http://host:port,...``, the GPU health
    daemons (``trainguard probe``) whose metrics the dashboard shows."""
    return os.environ.get(PROBES_ENV, "")


def push_tokens() -> str:
    """``$TRAINGUARD_PUSH_TOKENS`` as written (parsed by :mod:`ingest_service.service.auth`)."""
    return os.environ.get(PUSH_TOKENS_ENV, "")


def tokenize_processes(cores: int) -> int:
    """``$TRAINGUARD_TOKENIZE_PROCESSES``, else ``cores - 2`` when positive, else 0.

    Raises ValueError when the variable is set to something other than a number >= 0."""
    raw = os.environ.get(TOKENIZE_PROCESSES_ENV, "").strip()
    if not raw:
        return max(0, cores - 2)
    if not raw.isdigit():
        raise ValueError(f"{TOKENIZE_PROCESSES_ENV}={raw!r}: expected a number of processes >= 0")
    return int(raw)


def watchdog() -> str:
    """``$TRAINGUARD_WATCHDOG`` as written (parsed by ``WatchdogConfig.from_env``)."""
    return os.environ.get(WATCHDOG_ENV, "")


def loop_breaker() -> str:
    """``$TRAINGUARD_LOOP_BREAKER`` as written (parsed by ``LoopPolicy.from_env``)."""
    return os.environ.get(LOOP_BREAKER_ENV, "")
def node_id(explicit: str | None = None) -> str:
    """``explicit``, else ``$TRAINGUARD_NODE_ID``, else this machine's host name."""
    return explicit or os.environ.get(NODE_ID_ENV) or socket.gethostname()


def quarantine() -> tuple[float, int, float]:
    """(seconds a quarantine holds, failures that quarantine, their window in seconds)
    from ``$TRAINGUARD_QUARANTINE_S``, ``..._FAILURES``, ``..._WINDOW_S``.

    Raises ValueError naming the variable when one is set to something else than a
    number (a count for ``..._FAILURES``)."""
    out: list[float] = []
    for name, default in zip(QUARANTINE_ENVS, _QUARANTINE_DEFAULTS, strict=True):
        raw = os.environ.get(name, "").strip()
        try:
            out.append(type(default)(raw) if raw else default)
        except ValueError:
            kind = "a whole number" if isinstance(default, int) else "a number of seconds"
            raise ValueError(f"{name}={raw!r}: expected {kind} (default {default})") from None
    return out[0], int(out[1]), out[2]


def rdzv_worker() -> str:
    """``$TRAINGUARD_RDZV_WORKER`` as written (empty outside a worker of the trainguard
    rendezvous; parsed by ``trainguard.elastic.worker``)."""
    return os.environ.get(RDZV_WORKER_ENV, "")
