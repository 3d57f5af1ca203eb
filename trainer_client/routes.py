"""Fallback routes for remote model calls made during training (evaluation, reward
model, tokenizer service).

A :class:`RouteClient` holds an ordered list of routes: the primary, backups, and
optionally a :class:`LocalRoute` (an in-process callable, e.g. a smaller reward
model). Every call tries the routes in order and returns the first answer. Each route
has its own :class:`~trainguard.core.resilience.breaker.CircuitBreaker`: a route that keeps
failing is skipped without waiting for its timeout, and once its reset timeout has
passed the next call probes it; when the probe succeeds, calls are back on the
primary. When every route fails (or is open),
:class:`~trainer_client.errors.AllRoutesFailedError` lists each route's error.

HTTP routes POST JSON to ``base_url + path`` and expect JSON back. They use
``urllib`` (``trainer_client`` never imports aiohttp); :meth:`RouteClient.acall` runs
the same call in a worker thread. ``timeout_s`` is urllib's socket timeout: it bounds
connecting and each wait for data, so a server that hangs is abandoned after it.

What counts as a route failure: no connection, a timeout, HTTP 5xx, 408 or 429, an
answer that is not JSON, or any exception from a local route. Any other 4xx is the
request's fault: :class:`~trainer_client.errors.RouteRejectedError` is raised at once,
without trying other routes, and does not count against the route's breaker.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from trainer_client.errors import AllRoutesFailedError, RouteRejectedError
from trainguard.core.resilience.breaker import CircuitBreaker

__all__ = ["HttpRoute", "LocalRoute", "Route", "RouteClient", "RouteResponse"]

_RETRYABLE_4XX = frozenset({408, 429})


@dataclass(frozen=True)
class HttpRoute:
    name: str
    base_url: str
    timeout_s: float = 10.0
    headers: Mapping[str, str] = field(default_factory=dict)

    def invoke(self, path: str, payload: Any, timeout_s: float | None) -> Any:
        body = json.dumps(payload).encode()
        request = urllib.request.Request(
            self.base_url.rstrip("/") + path, data=body, method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json",
                     **self.headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            if 400 <= err.code < 500 and err.code not in _RETRYABLE_4XX:
                text = err.read().decode("utf-8", "replace")
                raise RouteRejectedError(self.name, err.code, text) from err
            raise
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ValueError(
                f"route {self.name!r} answered {len(raw)} bytes that are not JSON "
                f"(expected a JSON body): {raw[:100]!r}"
            ) from exc


@dataclass(frozen=True)
class LocalRoute:
    """An in-process fallback: ``fn(path, payload)`` returns the answer."""

    name: str
    fn: Callable[[str, Any], Any]

    def invoke(self, path: str, payload: Any, timeout_s: float | None) -> Any:
        return self.fn(path, payload)


Route = HttpRoute | LocalRoute


@dataclass(frozen=True)
class RouteResponse:
    route: str
    """Name of the route that answered."""
    value: Any
    """The decoded JSON answer (or the local route's return value)."""


class RouteClient:
    """Calls the first healthy route; see the module docstring. Thread-safe."""

    def __init__(
        self,
        name: str,
        routes: Sequence[Route],
        *,
        failure_threshold: int = 3,
        reset_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        names = [r.name for r in routes]
        if not routes or len(set(names)) != len(names):
            raise ValueError(f"RouteClient {name!r} needs at least one route and unique "
                             f"route names, got {names}")
        self.name = name
        self.routes = tuple(routes)
        self.breakers = {
            r.name: CircuitBreaker(
                f"{name}/{r.name}", failure_threshold=failure_threshold,
                reset_timeout_s=reset_timeout_s, ignored_exceptions=(RouteRejectedError,),
                clock=clock, registry=registry,
            )
            for r in routes
        }

    def call(self, path: str, payload: Any = None, *, timeout_s: float | None = None
             ) -> RouteResponse:
        """POST ``payload`` to ``path`` on the first route that answers.
        ``timeout_s`` overrides each HTTP route's own timeout for this call."""
        failures: dict[str, BaseException] = {}
        for route in self.routes:
            try:
                value = self.breakers[route.name].call(route.invoke, path, payload, timeout_s)
            except RouteRejectedError:
                raise
            except Exception as exc:  # includes CircuitOpenError: the route is resting
                failures[route.name] = exc
                continue
            return RouteResponse(route.name, value)
        raise AllRoutesFailedError(self.name, failures)

    async def acall(self, path: str, payload: Any = None, *, timeout_s: float | None = None
                    ) -> RouteResponse:
        """:meth:`call` in a worker thread, for event-loop callers."""
        return await asyncio.to_thread(self.call, path, payload, timeout_s=timeout_s)
