"""Quarantined nodes for the operator: list them, clear one.

Routes (documented in :mod:`ingest_service.service.nodes_openapi`)::

    GET  /admin/nodes                 the quarantine records that hold now (open: a
                                      node id, a reason and the probe report are no
                                      secret)
    POST /admin/nodes/{node}/clear    remove a node's record and failure count, so it
                                      may join again (admin token: a mutation)

The records are :mod:`trainguard.core.quarantine`'s (one Redis hash, times from the
Redis server's clock); the same functions serve ``trainguard nodes ls|clear``.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from ingest_service.errors import BadRequest, NotFound
from ingest_service.service.admin import require_token
from ingest_service.service.config import REDIS_KEY
from trainguard.core import quarantine as qr
from trainguard.core import streams

__all__ = ["ROUTES", "clear_node", "list_nodes", "setup_nodes"]


async def _now(r: aioredis.Redis) -> float:
    sec, usec = await r.time()
    return float(sec) + float(usec) / 1e6


def _view(rec: qr.QuarantineRecord, now: float) -> dict[str, Any]:
    return {**rec.to_dict(), "remaining_s": max(0.0, rec.expires_at - now)}


async def list_nodes(r: aioredis.Redis) -> list[dict[str, Any]]:
    """Every quarantine record that holds now, by node id; expired ones are removed."""
    now = await _now(r)
    holding, expired = qr.sort_entries(await r.hgetall(qr.quarantine_key()) or {}, now)
    for field, raw in expired:
        await r.eval(qr.DELETE_IF_UNCHANGED, 1, qr.quarantine_key(), field, raw)
    return [_view(rec, now) for rec in holding]


def _node(text: str) -> str:
    try:
        return streams.check_name("node", text)
    except streams.ContractError as exc:
        raise BadRequest("bad_name", str(exc)) from exc


async def clear_node(r: aioredis.Redis, node: str) -> dict[str, Any]:
    """Remove ``node``'s quarantine record and its failure count. Raises NotFound when
    it has no record (an expired one counts as none)."""
    now = await _now(r)
    raw = await r.hget(qr.quarantine_key(), _node(node))
    holding, _ = qr.sort_entries({node: raw} if raw is not None else {}, now)
    await r.hdel(qr.quarantine_key(), node)
    await r.delete(qr.failures_key(node))
    if not holding:
        raise NotFound("node_not_quarantined",
                       f"node {node!r} has no quarantine record that holds (none, or it "
                       "expired): it may join already; `trainguard nodes ls` lists them")
    return {"node": node, "cleared": True, "record": _view(holding[0], now)}


async def _list(request: web.Request) -> web.Response:
    return web.json_response({"nodes": await list_nodes(request.app[REDIS_KEY])})


async def _clear(request: web.Request) -> web.Response:
    require_token(request)
    return web.json_response(await clear_node(request.app[REDIS_KEY], request.match_info["node"]))


ROUTES = (
    ("GET", "/admin/nodes", _list),
    ("POST", "/admin/nodes/{node}/clear", _clear),
)


def setup_nodes(app: web.Application) -> None:
    """Add the routes above to the service ``app`` (after ``setup_admin``: the clear
    route checks its admin token)."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
