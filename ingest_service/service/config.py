"""The service's configuration and the typed keys under which the app holds its parts.

Other route modules (the admin API) reach the shared Redis client and config through
these keys: ``app[REDIS_KEY]``, ``app[CONFIG_KEY]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from redis.asyncio import Redis

from ingest_service.backlog import BacklogLimits
from ingest_service.metrics import IngestMetrics
from ingest_service.producer.leases import LEASE_MS
from ingest_service.push.body import BodyLimits
from ingest_service.service.auth import DEFAULT_ALLOWED_HOSTS, PushTokens
from trainguard.core import settings

__all__ = [
    "IngestConfig",
    "REDIS_KEY",
    "CONFIG_KEY",
    "METRICS_KEY",
]


@dataclass(frozen=True)
class IngestConfig:
    redis_url: str = settings.DEFAULT_REDIS_URL
    host: str = "127.0.0.1"
    port: int = 8080
    produce: bool = True
    """Run a producer in the background for every registered file dataset."""
    datasets: tuple[str, ...] | None = None
    """Only these datasets (None: all registered ones)."""
    discover_interval_s: float = 2.0
    """How often the service looks for newly registered datasets."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options of the sources (credentials, endpoint): never stored in Redis."""
    limits: BacklogLimits = field(default_factory=BacklogLimits)
    push_limits: BodyLimits = field(default_factory=BodyLimits)
    """Per push request: bytes, records, read timeouts (sized for RL rollouts)."""
    push_tokens: PushTokens = field(default_factory=PushTokens)
    """Producer tokens (``TRAINGUARD_PUSH_TOKENS``); none: push refused."""
    insecure_local: bool = False
    """Accept pushes without a token (the demo; ``trainguard serve`` allows it on a
    loopback address only)."""
    allowed_hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS
    """``Host`` names the service answers to (``"*"``: any; e.g. behind a proxy that checks)."""
    header_timeout_s: float = 30.0
    """A request's headers must be in within this long of the connection opening or of
    the previous answer on it (also the idle keep-alive limit): aiohttp's keep-alive
    timer closes a connection that is still waiting for a whole request then."""
    verify_threads: int = 2
    """Checkpoint verifications at once (``/verify``), in their own threads."""
    push_retry_after_s: int = 1
    push_wait_replicas: int | None = None
    """A push is acknowledged once this many replicas have it (``WAIT``); None: one when
    the partition's master has a replica (a cluster, a replicated Redis), else none."""
    push_wait_ms: int = 1000
    """How long a push waits for its replicas before it answers 503 (retry)."""
    push_wait_aof: bool | None = None
    """Acknowledge a push only once Redis' own append-only file has it on disk
    (``WAITAOF``) where no replica confirms it; None: where Redis has WAITAOF (7.2 on)
    and an AOF. With appendfsync everysec a push then waits for the next fsync (up to
    about a second); False trades that for up to a second of acknowledged pushes lost
    to a machine crash (a kill -9 of Redis loses none: the AOF is written first)."""
    push_pool_connections: int = 64
    """Redis connections of the push route at most; a push past them waits for one."""
    push_pool_wait_s: float = 5.0
    """How long a push waits for a connection before it answers 503 (retry)."""
    push_pool_idle_s: float = 10.0
    """Push connections idle this long are closed (four are kept)."""
    maintenance_interval_s: float = 1.0
    durability_interval_s: float = 1.0
    """How often the service reads Redis' INFO: a restarted Redis is assessed and
    checked against what was acknowledged (:mod:`ingest_service.push.durability`)."""
    lease_ms: int = LEASE_MS
    """Partition leases of the file producers (several services share a dataset)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight push requests may take to finish."""

    @classmethod
    def from_env(cls, **overrides: Any) -> IngestConfig:
        """Defaults, then ``TRAINGUARD_REDIS_URL`` and ``TRAINGUARD_PUSH_TOKENS``, then
        ``overrides`` (None ignored). Raises TokenConfigError for a blank or short token."""
        values: dict[str, Any] = {"redis_url": settings.redis_url(),
                                  "push_tokens": PushTokens.parse(settings.push_tokens())}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


REDIS_KEY = web.AppKey("trainguard_ingest_redis", Redis)
CONFIG_KEY = web.AppKey("trainguard_ingest_config", IngestConfig)
METRICS_KEY = web.AppKey("trainguard_ingest_metrics", IngestMetrics)
