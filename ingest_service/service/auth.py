"""Who may push, and from where: producer tokens, the Host check, bearer parsing.

Producer tokens are separate from the admin token. Each is scoped: it may push to
the datasets it names, and it owns the producer_ids it names (exact names, or
prefixes ending in ``*``), so one producer can never move another's mark. They come
from ``TRAINGUARD_PUSH_TOKENS``: entries separated by ``;`` or newlines, each
``<token>:<dataset>[,<dataset>...]:<producer>[,<producer>...]``, ``*`` meaning any
dataset or any producer_id. For example::

    TRAINGUARD_PUSH_TOKENS="k2J...Q:rollouts:actor-*;Zp0...f:evals,rollouts:evaluator"

Every token (push or admin) is compared in constant time, and the service refuses to
start with a token shorter than :data:`MIN_TOKEN_CHARS` characters: a guessable token
is worse than none, because it looks like protection.

The Host check (against DNS rebinding: a browser page whose name resolves to
127.0.0.1) answers 421 to a request whose ``Host`` is not one of the configured
names. Probes (``/healthz``, ``/readyz``, ``/metrics``) are exempt: orchestrators
send the pod's address.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from ingest_service.errors import Forbidden, Misdirected, TokenConfigError, Unauthorized
from trainguard.core import lists, settings

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "MIN_TOKEN_CHARS",
    "ProducerToken",
    "PushTokens",
    "bearer_token",
    "check_secret",
    "host_check_middleware",
    "host_name",
    "tokens_equal",
]

MIN_TOKEN_CHARS = 16
DEFAULT_ALLOWED_HOSTS = ("127.0.0.1", "localhost", "::1")
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


def check_secret(what: str, value: str) -> str:
    """``value`` if it is a usable token; raises TokenConfigError naming ``what``."""
    if not value.strip():
        raise TokenConfigError("bad_token", f"{what} is blank: set a random token "
                               "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`)")
    if len(value) < MIN_TOKEN_CHARS or not value.isascii() or not value.isprintable() \
            or value != value.strip():
        raise TokenConfigError(
            "bad_token",
            f"{what} is {len(value)} characters: expected at least {MIN_TOKEN_CHARS} printable "
            "ASCII characters without surrounding spaces; generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`",
        )
    return value


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time equality of a presented token with a configured one."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def bearer_token(request: web.Request) -> str:
    """The token of ``Authorization: Bearer <token>``; raises Unauthorized (401) when
    the header is missing, of another scheme, or not printable ASCII."""
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("unauthorized", "send 'Authorization: Bearer <token>'")
    if not given.isascii() or not given.isprintable():
        raise Unauthorized("unauthorized", "the bearer token must be printable ASCII")
    return given


def _matches(patterns: tuple[str, ...], name: str) -> bool:
    return any(p == "*" or p == name or (p.endswith("*") and name.startswith(p[:-1]))
               for p in patterns)


@dataclass(frozen=True)
class ProducerToken:
    token: str
    datasets: tuple[str, ...]
    producers: tuple[str, ...]

    def may_push(self, dataset: str, producer_id: str) -> bool:
        return _matches(self.datasets, dataset) and _matches(self.producers, producer_id)


@dataclass(frozen=True)
class PushTokens:
    """The configured producer tokens (possibly none)."""

    tokens: tuple[ProducerToken, ...] = ()

    @classmethod
    def parse(cls, text: str) -> PushTokens:
        out = []
        for n, entry in enumerate(text.replace("\n", ";").split(";"), 1):
            if not entry.strip():
                continue
            parts = entry.strip().split(":")
            if len(parts) != 3 or not parts[1].strip() or not parts[2].strip():
                raise TokenConfigError(
                    "bad_token",
                    f"{settings.PUSH_TOKENS_ENV} entry {n} is not valid: expected "
                    "'<token>:<dataset>[,...]:<producer_id or prefix*>[,...]'",
                )
            token = check_secret(f"{settings.PUSH_TOKENS_ENV} entry {n}'s token", parts[0])
            datasets, producers = tuple(lists.items(parts[1])), tuple(lists.items(parts[2]))
            out.append(ProducerToken(token, datasets, producers))
        return cls(tuple(out))

    def authorize(self, request: web.Request, dataset: str, producer_id: str) -> None:
        """Passes when the request's bearer token may push ``producer_id`` to ``dataset``;
        else raises Unauthorized (401: no or unknown token) or Forbidden (403: out of the
        token's scope). Every configured token is compared, so timing says nothing about
        which one matched."""
        given = bearer_token(request)
        found: ProducerToken | None = None
        for candidate in self.tokens:
            if tokens_equal(given, candidate.token) and found is None:
                found = candidate
        if found is None:
            raise Unauthorized("unauthorized", "the bearer token is not a producer token of "
                               "this service")
        if not found.may_push(dataset, producer_id):
            raise Forbidden(
                "forbidden",
                f"this producer token may not push producer_id {producer_id!r} to dataset "
                f"{dataset!r}: it covers datasets {list(found.datasets)} and producer_ids "
                f"{list(found.producers)}",
            )


def host_name(header: str) -> str:
    """``"[::1]:8080"`` -> ``"::1"``, ``"Example.org:80"`` -> ``"example.org"``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_check_middleware(allowed: Iterable[str]) -> Middleware:
    """A middleware answering 421 to requests whose Host is not in ``allowed``
    (``"*"``: any)."""
    names = frozenset(h.lower() for h in allowed)

    @web.middleware
    async def check_host(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "*" not in names and request.path not in _PROBES:
            host = host_name(request.headers.get("Host", ""))
            if host not in names:
                raise Misdirected(
                    "misdirected",
                    f"Host {host!r} is not served here: expected one of {sorted(names)}; "
                    "start the service with --allowed-host NAME for the name clients use",
                )
        return await handler(request)

    return check_host
