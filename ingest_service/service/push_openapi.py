"""The OpenAPI parts of the push edge's own additions: the fields of a push's 409s and
``GET /v1/push/durability`` (:mod:`ingest_service.push.durability`), merged into the
service's document by :mod:`ingest_service.service.openapi`."""

from __future__ import annotations

from typing import Any

__all__ = ["PUSH_409_FIELDS", "push_paths"]

PUSH_409_FIELDS: dict[str, Any] = {
    "appended": {"type": "integer", "description": "batch_mismatch: records in under seq"},
    "count": {"type": "integer", "description": "batch_mismatch: records of the batch in"},
    "digest": {"type": "string", "description": "batch_mismatch: that batch's digest"},
    "acknowledged": {"type": "integer", "description": "lost_acknowledged_data: the last "
                     "seq acknowledged; those after the mark up to it are lost"},
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def push_paths() -> dict[str, Any]:
    return {
        "/v1/push/durability": {
            "get": {
                "operationId": "pushDurability",
                "summary": "Whether Redis keeps acknowledged pushes across a restart, and "
                           "the acknowledged pushes it lost, per dataset",
                "responses": {"200": _json({"type": "object", "properties": {
                    "durability": {"type": "object"},
                    "lost_acknowledged_data": {"type": "object"}}}, "the report")},
            }
        },
    }
