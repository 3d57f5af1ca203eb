"""The OpenAPI 3.0 document of the service, as data.

Served at ``/openapi.json``; ``tests/test_admin_openapi.py`` keeps it equal to the
aiohttp router of ``create_app`` (every route documented, nothing documented that is
not routed) and fuzzes every operation from it. When you add a route, add it here.
"""

from __future__ import annotations

import copy
from typing import Any

from ingest_service.push.body import BodyLimits
from ingest_service.push.ingest import PROBE_SEQ
from ingest_service.service.nodes_openapi import nodes_paths
from ingest_service.service.push_openapi import PUSH_409_FIELDS, push_paths
from ingest_service.service.runs_openapi import PAGE_FIELDS, PAGE_PARAMETERS, runs_paths
from ingest_service.service.tier_places import TIERS_SCHEMA
from trainguard import __version__
from trainguard.core import groups
from trainguard.core.checkpoints import CHECKPOINT_STATUSES

__all__ = ["openapi_document"]

_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,128}$"}
_ID = {"type": "string", "pattern": r"^[0-9]{1,19}-[0-9]{1,19}$", "example": "1-41"}
_NULLABLE_ID = {**_ID, "nullable": True}
_FORCE = {"type": "boolean", "default": False}
_RECORD = {
    "description": "A record: any JSON value, integers within 64 bits (this schema shows "
                   "one common shape)",
    "type": "object",
    "additionalProperties": {"type": "string"},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str,
          links: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": schema}}}
    return {**out, "links": links} if links else out


def _errors(*statuses: int) -> dict[str, Any]:
    text = {
        400: "malformed input (name, ID, partition, step or body)",
        401: "no bearer token sent",
        403: "wrong token, or the service has no admin token (mutations disabled)",
        404: "unknown dataset, group, store or checkpoint",
        408: "the body did not arrive in time",
        409: "refused in the current state (below the retention floor, pinned, newest; "
             "a push seq out of order, with the producer's mark)",
        413: "body too large",
        415: "content type not accepted",
        421: "Host is not a name this service answers to",
        429: "backlog full, or too many verifications at once: retry after Retry-After seconds",
        503: "Redis or a checkpoint store is unreachable, or the service is shutting down",
    }
    return {str(s): _json(_ref("Error"), text[s]) for s in statuses}


def _param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema,
            "description": description}


_DATASET = _param("dataset", _NAME, "dataset name")
_GROUP = _param("group", _NAME, "consumer group (one per training run)")
_STORE = _param("store", _NAME, "configured checkpoint store name")
_STEP = _param("step", {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
               "checkpoint step")
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}]

_READ_ERRORS = (400, 404, 503)
_WRITE_ERRORS = (400, 401, 403, 404, 409, 413, 503)

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                               "mark": {"type": "integer", "nullable": True,
                                        "description": "409 of a push: the producer's mark"},
                               **PUSH_409_FIELDS},
            }
        },
    },
    "Partition": {
        "type": "object",
        "properties": {
            "partition": {"type": "integer"},
            "length": {"type": "integer"},
            "first_id": _NULLABLE_ID,
            "last_id": _NULLABLE_ID,
            "last_generated_id": _NULLABLE_ID,
            "max_deleted_id": _NULLABLE_ID,
            "removed_below": {**_NULLABLE_ID, "description": "entries at or below this ID may have been trimmed"},
            "bytes": {"type": "integer",
                      "description": "Redis MEMORY USAGE of the stream key (sampled estimate)"},
            "producer_position": {
                "type": "object", "nullable": True,
                "properties": {"epoch": {"type": "integer"}, "records": {"type": "integer"}},
            },
            "paused": {"type": "boolean"},
            "retention_floor": _NULLABLE_ID,
        },
    },
    "Dataset": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "spec": {"type": "object"},
            "partitions": {"type": "array", "items": _ref("Partition")},
            "bytes_method": {"type": "string"},
            "dead_letters": {"type": "integer"},
            "producer": {"type": "object"},
            "groups": {"type": "array", "items": {"type": "string"}},
        },
    },
    "GroupPartition": {
        "type": "object",
        "properties": {
            "partition": {"type": "integer"},
            "exists": {"type": "boolean"},
            "last_delivered_id": _NULLABLE_ID,
            "committed": _NULLABLE_ID,
            "retention_floor": _NULLABLE_ID,
            "lag": {"type": "integer", "nullable": True},
            "pending": {"type": "integer"},
            "consumers": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "pending": {"type": "integer"},
                                   "idle_ms": {"type": "integer"}},
                },
            },
        },
    },
    "SeekRequest": {
        "description": "Exactly one of: to, ids, checkpoint; optionally force (seek "
                       "even while a consumer of the group read in the last 30 s).",
        "oneOf": [
            {"type": "object", "required": ["to"], "additionalProperties": False,
             "properties": {"to": {"type": "string", "enum": list(groups.SEEK_TARGETS)},
                            "force": _FORCE}},
            {"type": "object", "required": ["ids"], "additionalProperties": False,
             "properties": {"ids": {"type": "object", "minProperties": 1,
                                    "patternProperties": {"^[0-9]{1,4}$": _ID},
                                    "additionalProperties": False,
                                    "description": "partition (as a string) -> stream ID"},
                            "force": _FORCE}},
            {"type": "object", "required": ["checkpoint"], "additionalProperties": False,
             "properties": {"checkpoint": {
                 "type": "object", "required": ["store", "step"], "additionalProperties": False,
                 "properties": {"store": _NAME,
                                "step": {"type": "integer", "minimum": 0, "maximum": 10**18 - 1}}},
                 "force": _FORCE}},
        ],
    },
    "Offsets": {
        "type": "object",
        "properties": {
            "dataset": {"type": "string"},
            "group": {"type": "string"},
            "offsets": {"type": "object", "additionalProperties": _ID},
        },
    },
    "PushReply": {
        "type": "object",
        "required": ["appended", "partition", "seq", "mark", "count"],
        "properties": {
            "appended": {"type": "boolean"},
            "partition": {"type": "integer"},
            "seq": {"type": "integer"},
            "mark": {"type": "integer"},
            "count": {"type": "integer", "description": "records this request appended"},
            "first_id": _NULLABLE_ID,
            "last_id": _NULLABLE_ID,
        },
    },
    "Checkpoint": {
        "type": "object",
        "properties": {
            "step": {"type": "integer"},
            "uid": {"type": "string"},
            "name": {"type": "string"},
            "created_at": {"type": "number", "nullable": True},
            "nbytes": {"type": "integer", "nullable": True},
            "parent": {"type": "string", "nullable": True},
            "world_size": {"type": "integer", "nullable": True},
            "pinned": {"type": "boolean"}, "tiers": TIERS_SCHEMA,
            "status": {"type": "array", "items": {
                "type": "string", "enum": list(CHECKPOINT_STATUSES)}},
        },
        "required": ["step", "uid", "name", "created_at", "nbytes", "parent", "world_size",
                     "pinned", "status", "tiers"],
    },
}


def _pin_op(operation_id: str, done: str, summary: str) -> dict[str, Any]:
    """Pin and unpin: one shape, a POST on a checkpoint answering the checkpoint."""
    return {"post": {
        "operationId": operation_id,
        "summary": summary,
        "security": _BEARER,
        "parameters": [_STORE, _STEP],
        "responses": {"200": _json(_ref("Checkpoint"), done), **_errors(*_WRITE_ERRORS)},
    }}


def _paths() -> dict[str, Any]:
    return {
        "/admin/datasets": {
            "get": {
                "operationId": "listDatasets",
                "summary": "Datasets with totals over their partitions",
                "responses": {
                    "200": _json({"type": "object", "properties": {
                        "datasets": {"type": "array", "items": {"type": "object"}}}},
                        "datasets", links={
                            "ShowDataset": {"operationId": "showDataset", "parameters": {
                                "dataset": "$response.body#/datasets/0/name"}},
                            "ListGroups": {"operationId": "listGroups", "parameters": {
                                "dataset": "$response.body#/datasets/0/name"}},
                        }),
                    **_errors(503),
                },
            }
        },
        "/admin/datasets/{dataset}": {
            "get": {
                "operationId": "showDataset",
                "summary": "A dataset's spec and partitions",
                "parameters": [_DATASET],
                "responses": {"200": _json(_ref("Dataset"), "the dataset"),
                              **_errors(*_READ_ERRORS, 409)},
            }
        },
        "/admin/datasets/{dataset}/groups": {
            "get": {
                "operationId": "listGroups",
                "summary": "Consumer groups: delivered, committed, lag, pending, consumers",
                "parameters": [_DATASET],
                "responses": {
                    "200": _json({"type": "object", "properties": {
                        "dataset": {"type": "string"},
                        "groups": {"type": "array", "items": {"type": "object", "properties": {
                            "group": {"type": "string"},
                            "partitions": {"type": "array", "items": _ref("GroupPartition")},
                        }}},
                    }}, "groups", links={
                        "SeekGroup": {"operationId": "seekGroup", "parameters": {
                            "dataset": "$request.path.dataset",
                            "group": "$response.body#/groups/0/group"}},
                    }),
                    **_errors(*_READ_ERRORS, 409),
                },
            }
        },
        "/admin/datasets/{dataset}/groups/{group}/seek": {
            "post": {
                "operationId": "seekGroup",
                "summary": "Move a group to a checkpoint's offsets, explicit IDs, "
                           "earliest or latest; refused below the retention floor",
                "security": _BEARER,
                "parameters": [_DATASET, _GROUP],
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref("SeekRequest")}}},
                "responses": {"200": _json(_ref("Offsets"), "the offsets set"),
                              **_errors(*_WRITE_ERRORS)},
            }
        },
        "/admin/checkpoints": {
            "get": {
                "operationId": "listStores",
                "summary": "Configured checkpoint stores",
                "responses": {"200": _json({"type": "object"}, "stores", links={
                    "ListCheckpoints": {"operationId": "listCheckpoints", "parameters": {
                        "store": "$response.body#/stores/0/name"}},
                }), **_errors(503)},
            }
        },
        "/admin/checkpoints/{store}": {
            "get": {
                "operationId": "listCheckpoints",
                "summary": "Checkpoints of a store, oldest first, a page at a time",
                "parameters": [_STORE, *PAGE_PARAMETERS],
                "responses": {
                    "200": _json({"type": "object", "properties": {
                        "store": {"type": "string"},
                        "checkpoints": {"type": "array", "items": _ref("Checkpoint")},
                        **PAGE_FIELDS}},
                        "checkpoints", links={
                            op: {"operationId": op, "parameters": {
                                "store": "$request.path.store",
                                "step": "$response.body#/checkpoints/0/step"}}
                            for op in ("showCheckpoint", "verifyCheckpoint", "pinCheckpoint",
                                       "unpinCheckpoint")
                        }),
                    **_errors(*_READ_ERRORS),
                },
            }
        },
        "/admin/checkpoints/{store}/{step}": {
            "get": {
                "operationId": "showCheckpoint",
                "summary": "A checkpoint's list row; with a read or admin token its whole "
                           "manifest (extra, tensor index, random states)",
                "parameters": [_STORE, _STEP],
                "responses": {"200": _json({"type": "object"}, "the manifest"),
                              **_errors(*_READ_ERRORS)},
            },
            "delete": {
                "operationId": "deleteCheckpoint",
                "summary": ("Delete a checkpoint from local disk; a remote tier keeps its copy "
                            "(refuses pinned ones and the newest valid)"),
                "security": _BEARER,
                "parameters": [_STORE, _STEP],
                "responses": {"200": _json({"type": "object"}, "deleted"),
                              **_errors(*_WRITE_ERRORS)},
            },
        },
        "/admin/checkpoints/{store}/{step}/verify": {
            "get": {
                "operationId": "verifyCheckpoint",
                "summary": "Verify a checkpoint's checksums",
                "parameters": [_STORE, _STEP],
                "responses": {
                    "200": _json({"type": "object", "properties": {
                        "step": {"type": "integer"}, "valid": {"type": "boolean"},
                        "reason": {"type": "string", "nullable": True}}}, "the verdict"),
                    **_errors(*_READ_ERRORS, 429),
                },
            }
        },
        "/admin/checkpoints/{store}/{step}/pin": _pin_op(
            "pinCheckpoint", "pinned",
            "Pin a checkpoint in every tier that has it: retention and delete keep it"),
        "/admin/checkpoints/{store}/{step}/unpin": _pin_op(
            "unpinCheckpoint", "unpinned", "Unpin a checkpoint in every tier that has it"),
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Process up",
                "responses": {"200": _json({"type": "object"}, "serving")},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Redis and every configured checkpoint store reachable",
                "responses": {
                    "200": _json({"type": "object"}, "ready"),
                    "503": _json({"type": "object"}, "not ready, with the reasons"),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics (text exposition format)",
                "responses": {"200": {"description": "metrics",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}}},
            }
        },
        "/v1/datasets/{name}/records": {
            "post": {
                "operationId": "pushRecords",
                "summary": "Push a batch of records to a push dataset (exactly once per "
                           "producer_id and seq; see the README's push contract)",
                "description": "Needs a producer token whose scope covers the dataset and the "
                               "producer_id. seq must be the producer's mark + 1 (0 without a "
                               "mark); at or below the mark the batch is in already (200, "
                               "appended false); otherwise 409 out_of_order with the mark. "
                               "409 batch_mismatch: another batch (count, digest) is partly "
                               "in under this seq; resend that one whole. 409 "
                               "lost_acknowledged_data: Redis lost acknowledged batches of "
                               "this producer (mark, acknowledged), said once. seq 2^53-1 is a "
                               "probe: never appended, answered 409 with the mark. 413: the "
                               "body, a record, or a record's lists and maps (count, nesting) "
                               "over the limit, or its decode past the timeout; 503 busy: body "
                               "budget or decode pool full, or its worker died. Bodies: application/"
                               "x-ndjson (one JSON value per line), application/json "
                               "(one array) or application/msgpack (one array; bin items stay "
                               "bytes); the schemas below show one shape of each text format.",
                "security": _BEARER,
                "parameters": [
                    {**_param("name", _NAME, "push dataset name")},
                    {"name": "producer_id", "in": "query", "required": True, "schema": _NAME},
                    {"name": "seq", "in": "query", "required": True,
                     "schema": {"type": "integer", "minimum": 0, "maximum": PROBE_SEQ}},
                ],
                "requestBody": {"required": True, "content": {
                    "application/x-ndjson": {"schema": {
                        "type": "string", "pattern": "^(-?[0-9]{1,15}\n){1,1000}$"}},
                    "application/json": {"schema": {
                        "type": "array", "minItems": 1, "maxItems": BodyLimits.max_records,
                        "items": _RECORD}},
                }},
                "responses": {
                    "200": _json(_ref("PushReply"), "appended (or a retry already appended)",
                                 links={"RetryPush": {"operationId": "pushRecords", "parameters": {
                                     "name": "$request.path.name",
                                     "producer_id": "$request.query.producer_id",
                                     "seq": "$response.body#/mark"}}}),
                    **_errors(400, 401, 403, 404, 408, 409, 413, 415, 429, 503),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3 document")},
            }
        },
    }


def openapi_document() -> dict[str, Any]:
    """A fresh copy of the document (callers may change theirs)."""
    return copy.deepcopy(
        {
            "openapi": "3.0.3",
            "info": {
                "title": "trainguard ingest service",
                "version": __version__,
                "description": "Ingest and admin API of trainguard. Errors are "
                               '{"error": {"code", "message"}}; mutating admin routes need '
                               "Authorization: Bearer <TRAINGUARD_ADMIN_TOKEN>, pushes a "
                               "producer token of TRAINGUARD_PUSH_TOKENS.",
            },
            "paths": {**_paths(), **runs_paths(), **nodes_paths(), **push_paths()},
            "components": {
                "schemas": _SCHEMAS,
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            },
        }
    )
