"""The documents that cross the admin API, the CLI and OpenAPI have one shape, defined
once in trainguard/core: the hand-written OpenAPI schema of a run
(``ingest_service.service.runs_openapi``) names exactly the fields of those types, so
a field added to one and not the other fails here."""

from __future__ import annotations

import dataclasses
from typing import Any

from ingest_service.service.runs_openapi import runs_paths
from trainguard.core.history import CheckpointRow
from trainguard.core.interval import Advice


def _run_schema() -> dict[str, Any]:
    get = runs_paths()["/admin/runs/{group}"]["get"]
    schema: dict[str, Any] = get["responses"]["200"]["content"]["application/json"]["schema"]
    return schema


def test_openapi_checkpoint_rows_name_exactly_the_fields_of_checkpoint_row() -> None:
    """``checkpoints[].properties`` of ``showRun`` == the keys of CheckpointRow
    (required and NotRequired), no more, no fewer."""
    items = _run_schema()["properties"]["checkpoints"]["items"]["properties"]
    assert set(items) == set(CheckpointRow.__annotations__)
    assert set(CheckpointRow.__required_keys__) == set(items) - {"status"}


def test_openapi_advice_names_exactly_the_fields_of_advice() -> None:
    """``advice.properties`` of ``showRun`` == the fields of the Advice dataclass that
    ``Advice.to_json`` sends."""
    advice = _run_schema()["properties"]["advice"]["properties"]
    assert set(advice) == {f.name for f in dataclasses.fields(Advice)}
