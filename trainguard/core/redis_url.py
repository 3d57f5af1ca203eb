"""Which Redis a URL names: one server, or a Redis Cluster.

Every part reads ``TRAINGUARD_REDIS_URL`` (or a ``--redis-url`` flag) through
:func:`parse`, and its client constructor (``trainer_client.redis_client`` sync,
``ingest_service.redis_client`` asyncio) builds redis-py's ``Redis`` or ``RedisCluster``
from the result, so the mode is chosen in one place:

``redis://host:port/db``, ``rediss://...``, ``unix://...``
    one server, exactly as redis-py's ``Redis.from_url`` reads it.
``redis+cluster://[user:password@]host:port[,host:port...]``
    a Redis Cluster (``rediss+cluster://`` for TLS). The nodes listed are where the
    client starts looking; it learns the rest from the cluster, so one reachable node
    is enough, and listing several survives one of them being down. A cluster has
    only database 0: a path other than ``/`` or ``/0`` is refused.

The foundation imports no redis: this module only reads the URL.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from trainguard.core.errors import TrainguardError

__all__ = ["CLUSTER_SCHEMES", "RedisTarget", "RedisUrlError", "parse"]

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
"""Cluster URL schemes and whether they use TLS."""


class RedisUrlError(TrainguardError, ValueError):
    """A Redis URL trainguard cannot use."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL. ``url`` is the URL as given (single mode passes it to
    redis-py unchanged); the rest is only set for a cluster."""

    url: str
    cluster: bool
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse(url: str) -> RedisTarget:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise RedisUrlError(
            f"Redis URL {url!r} has no scheme: expected redis://host:port/db for one "
            "server or redis+cluster://host:port,host:port for a Redis Cluster"
        )
    if scheme not in CLUSTER_SCHEMES:
        return RedisTarget(url=url, cluster=False)
    # urlsplit would read the comma list as one odd port: split the netloc ourselves.
    netloc, _, path = rest.partition("/")
    path = path.split("?", 1)[0]
    if path not in ("", "0"):
        raise RedisUrlError(
            f"Redis URL {url!r} names database {path!r}: a Redis Cluster has only "
            "database 0; drop the path"
        )
    creds, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    nodes = []
    for item in hosts.split(","):
        parts = urlsplit(f"//{item}")
        try:
            port = parts.port or 6379
        except ValueError:
            port = -1
        if not parts.hostname or port <= 0:
            raise RedisUrlError(
                f"Redis URL {url!r}: node {item!r} is not host:port; expected "
                f"{scheme}://host:port[,host:port...]"
            )
        nodes.append((parts.hostname, port))
    return RedisTarget(
        url=url, cluster=True, nodes=tuple(nodes), username=username, password=password,
        ssl=CLUSTER_SCHEMES[scheme],
    )
