"""The OpenAPI paths of the run history, dataset detail and dashboard routes
(:mod:`ingest_service.service.runs`, :mod:`ingest_service.service.ui`), merged into the service's
document by :mod:`ingest_service.service.openapi`."""

from __future__ import annotations

from typing import Any

from ingest_service.service.tier_places import TIERS_SCHEMA

PAGE_PARAMETERS = [
    {"name": "offset", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 0, "maximum": 10**9},
     "description": "rows to skip (default 0)"},
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 0, "maximum": 1000},
     "description": "rows in the page (at most 1000)"},
]
PAGE_FIELDS = {"total": {"type": "integer"}, "offset": {"type": "integer"},
               "limit": {"type": "integer"}}

__all__ = ["PAGE_FIELDS", "PAGE_PARAMETERS", "runs_paths"]

_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,128}$"}
_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "malformed name", 404: "unknown dataset or run",
            409: "the run name exists on several datasets: add ?dataset=",
            503: "Redis or a checkpoint store is unreachable"}
    return {str(s): _json(_ERROR, text[s]) for s in statuses}


_SECONDS = {"type": "number", "nullable": True}
_ADVICE = {
    "type": "object", "nullable": True,
    "description": "Young/Daly checkpoint interval advice (trainguard.core.interval)",
    "properties": {k: _SECONDS for k in (
        "recommended_s", "mtbf_s", "blocked_s", "durable_s", "observed_s", "current_s",
        "lost_recommended_s", "lost_current_s")} | {
        "failures": {"type": "integer"}, "bound": {"type": "string", "nullable": True},
        "formula": {"type": "string"}},
}
_RUN = {
    "type": "object",
    "properties": {
        "run": {"type": "string"}, "dataset": {"type": "string"},
        "store": {"type": "string", "nullable": True,
                  "description": "configured store name (never its URL)"},
        "checkpoints": {"type": "array", "items": {"type": "object", "properties": {
            "step": {"type": "integer"}, "name": {"type": "string"},
            "created_at": _SECONDS, "nbytes": {"type": "integer", "nullable": True},
            "generation": {"type": "integer"}, "commit": {"type": "integer"},
            "world_size": {"type": "integer"}, "num_workers": {"type": "integer"},
            "pinned": {"type": "boolean"}, "blocked_s": _SECONDS, "durable_s": _SECONDS,
            "skipped": {"type": "integer"},
            "status": {"type": "array", "items": {"type": "string"},
                       "description": "committed, pinned, remote | local_only"},
            "tiers": TIERS_SCHEMA}}},
        "restarts": {"type": "array", "items": {"type": "object"}, "description": (
            "every restart, in generation order: at, generation, resumed_step, "
            "steps_redone; from the manifests (seen_in: manifests, with "
            "last_committed_step and first_step_after) or, once retention pruned the "
            "manifest that showed it, from the recorded attempts (seen_in: attempts); "
            "cause and attempt where Redis recorded the failure")},
        "training": {"type": "object", "description": (
            "what the loop reported with session.log (trainguard.core.trainlog): points "
            "(at, step, values), the newest step and values (loss, ...), steps_per_s, "
            "steps_left, eta_s, and heartbeat: status (training, stalled, finished, "
            "failed, unknown), last_progress_at, age_s, limit_s, advice")},
        "rollbacks": {"type": "array", "items": {"type": "object"}},
        "world": {"type": "array", "items": {"type": "object"}},
        "totals": {"type": "object"},
        "advice": _ADVICE,
        "group": {"type": "object", "description": "the consumer group's lag per partition"},
        "attempts": {"type": "array", "description": (
            "every start of the run's trainers, oldest first (trainguard.core.incidents): "
            "attempt, pid, host, world_size, restart_count, started_at, imported_at, "
            "session_at, restored_at, restored_step, first_step_at, outcome "
            "(running, ok, failed, stopped, refused)"),
            "items": {"type": "object"}},
        "incidents": {"type": "array", "description": (
            "one per failure, oldest first: cause (hang, crash, killed, restart_loop), "
            "detected_by, detected_at, failed_at, detection_latency_s, step, signature, "
            "batches in flight, the ranks' reports (stacks and messages left out here), "
            "world_before, remedy (what the next attempt did), recovery (world_after, "
            "restored_step, steps_redone, records_redone, phases_s: detect, restart, "
            "imports, session, restore, first_step); a restart_loop incident says what "
            "was tried and where to look"),
            "items": {"type": "object"}},
        "failures": {"type": "integer",
                     "description": "failed attempts Redis recorded (the advice uses them)"},
    },
}


def runs_paths() -> dict[str, Any]:
    return {
        "/admin/runs": {"get": {
            "operationId": "listRuns",
            "summary": "Every run (consumer group) with checkpoints, restarts, lag, advice, "
                       "a page at a time; stores that cannot be read in store_errors",
            "parameters": PAGE_PARAMETERS,
            "responses": {"200": _json({"type": "object", "properties": {
                "runs": {"type": "array", "items": {"type": "object"}}, **PAGE_FIELDS,
                "store_errors": {"type": "object",
                                 "additionalProperties": {"type": "string"}}}}, "runs"),
                **_errors(400, 503)},
        }},
        "/admin/runs/{group}": {"get": {
            "operationId": "showRun",
            "summary": "A run's history from its manifests, its group's lag, the advice",
            "parameters": [
                {"name": "group", "in": "path", "required": True, "schema": _NAME,
                 "description": "the run (its consumer group)"},
                {"name": "dataset", "in": "query", "required": False, "schema": _NAME,
                 "description": "the run's dataset, when its name is used on several"}],
            "responses": {"200": _json(_RUN, "the run"), **_errors(400, 404, 409, 503)},
        }},
        "/admin/datasets/{dataset}/detail": {"get": {
            "operationId": "datasetDetail",
            "summary": "Partitions, groups' lag, newest dead letters, throughput over time",
            "parameters": [{"name": "dataset", "in": "path", "required": True,
                            "schema": _NAME, "description": "dataset name"}],
            "responses": {"200": _json({"type": "object"}, "the dataset, no source path"),
                          **_errors(400, 404, 409, 503)},
        }},
        "/admin/health": {"get": {
            "operationId": "nodesHealth",
            "summary": "GPU health of the nodes whose probes TRAINGUARD_PROBES names",
            "responses": {"200": _json({"type": "object", "properties": {
                "nodes": {"type": "array", "items": {"type": "object", "properties": {
                    "node": {"type": "string"},
                    "status": {"type": "string",
                               "enum": ["OK", "WARN", "CRITICAL", "UNKNOWN", "UNREACHABLE"]},
                    "gpus": {"type": "array", "items": {"type": "object"}}}}}}},
                "nodes, read now from their daemons' /metrics")},
        }},
        "/ui": {"get": {
            "operationId": "dashboard",
            "summary": "The dashboard (HTML; its files under /ui/static/)",
            "responses": {"200": {"description": "the page",
                                  "content": {"text/html": {"schema": {"type": "string"}}}}},
        }},
    }
