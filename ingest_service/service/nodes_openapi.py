"""The OpenAPI paths of the quarantined nodes' routes (:mod:`ingest_service.service.nodes`),
merged into the service's document by :mod:`ingest_service.service.openapi`."""

from __future__ import annotations

from typing import Any

__all__ = ["nodes_paths"]

_NODE = {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,128}$"}
_ERROR = {"$ref": "#/components/schemas/Error"}
_ERRORS = {400: "malformed node id", 401: "no bearer token sent",
           403: "wrong token, or the service has no admin token (mutations disabled)",
           404: "the node has no quarantine record that holds", 503: "Redis is unreachable"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): _json(_ERROR, _ERRORS[s]) for s in statuses}


_TIME = {"type": "number", "description": "Unix seconds, the Redis server's clock"}
RECORD = {
    "type": "object",
    "required": ["node", "reason", "source", "report", "created_at", "expires_at", "version"],
    "properties": {
        "version": {"type": "integer"},
        "node": {"type": "string"},
        "reason": {"type": "string"},
        "source": {"type": "string", "enum": ["probe", "trainer", "failures", "unreadable"],
                   "description": "who wrote it: the gate's probe, the trainer on a CRITICAL "
                                  "report, the failure count"},
        "report": {"type": "object", "nullable": True,
                   "description": "the GPU health probe report that caused it"},
        "created_at": _TIME, "expires_at": _TIME,
        "remaining_s": {"type": "number", "description": "seconds until it expires"},
    },
}


def nodes_paths() -> dict[str, Any]:
    return {
        "/admin/nodes": {"get": {
            "operationId": "listQuarantinedNodes",
            "summary": "Quarantined nodes: the records that keep them out of jobs",
            "responses": {"200": _json({"type": "object", "properties": {
                "nodes": {"type": "array", "items": RECORD}}}, "records that hold now"),
                **_errors(503)},
        }},
        "/admin/nodes/{node}/clear": {"post": {
            "operationId": "clearNodeQuarantine",
            "summary": "Clear a node's quarantine record (and failure count): it may join again",
            "security": [{"bearer": []}],
            "parameters": [{"name": "node", "in": "path", "required": True, "schema": _NODE,
                            "description": "node id (TRAINGUARD_NODE_ID, else its host name)"}],
            "responses": {"200": _json({"type": "object", "properties": {
                "node": {"type": "string"}, "cleared": {"type": "boolean"},
                "record": RECORD}}, "cleared"), **_errors(400, 401, 403, 404, 503)},
        }},
    }
