"""The documents that cross the admin API, the CLI and OpenAPI have one shape, defined
once in trainguard/core: the hand-written OpenAPI schemas of a run
(``ingest_service.service.runs_openapi``) and of a checkpoint name exactly the fields of
those types, and the admin API and the CLI send the same document, so a field added to
one and not the other fails here."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, get_args

import pytest

from checkpoint_store import CheckpointStore
from ingest_service.service.nodes_openapi import RECORD
from ingest_service.service.openapi import openapi_document
from ingest_service.service.runs_openapi import runs_paths
from tests.admin_helpers import admin_client, save_checkpoints
from trainguard.core.checkpoints import CheckpointStatus, CheckpointSummary
from trainguard.core.history import CheckpointRow
from trainguard.core.interval import Advice
from trainguard.core.quarantine import QuarantineDoc, QuarantineRecord, Source
from trainguard.core.streams import ContractError
from trainguard.ops.cli import main


def _run_schema() -> dict[str, Any]:
    get = runs_paths()["/admin/runs/{group}"]["get"]
    schema: dict[str, Any] = get["responses"]["200"]["content"]["application/json"]["schema"]
    return schema


def test_openapi_checkpoint_rows_name_exactly_the_fields_of_checkpoint_row() -> None:
    """``checkpoints[].properties`` of ``showRun`` == the keys of CheckpointRow
    (required and NotRequired), no more, no fewer."""
    items = _run_schema()["properties"]["checkpoints"]["items"]["properties"]
    assert set(items) == set(CheckpointRow.__annotations__)
    assert set(CheckpointRow.__required_keys__) == set(items) - {"status", "tiers"}


def test_openapi_advice_names_exactly_the_fields_of_advice() -> None:
    """``advice.properties`` of ``showRun`` == the fields of the Advice dataclass that
    ``Advice.to_json`` sends."""
    advice = _run_schema()["properties"]["advice"]["properties"]
    assert set(advice) == {f.name for f in dataclasses.fields(Advice)}


def test_openapi_quarantine_record_is_exactly_quarantine_doc() -> None:
    """The node quarantine record of the OpenAPI document: its properties are
    QuarantineDoc's keys plus the ``remaining_s`` the admin API adds, every key of
    QuarantineDoc is required, and the ``source`` enum is the Source type."""
    assert set(RECORD["properties"]) == set(QuarantineDoc.__annotations__) | {"remaining_s"}
    assert set(RECORD["required"]) == set(QuarantineDoc.__required_keys__)
    assert RECORD["properties"]["source"]["enum"] == list(get_args(Source))


def test_a_stored_record_with_an_unknown_source_is_refused_by_name() -> None:
    """A stored record whose source is outside Source does not parse (ContractError
    naming the source and the ones expected); one with a known source round-trips
    to the same record and the same document."""
    rec = QuarantineRecord(node="n1", reason="xid 79", source="probe", created_at=1.0,
                           expires_at=2.0, report={"gpus": []})
    assert QuarantineRecord.parse(rec.to_json()) == rec
    assert rec.to_dict() == {"version": 1, "node": "n1", "reason": "xid 79", "source": "probe",
                             "report": {"gpus": []}, "created_at": 1.0, "expires_at": 2.0}
    forged = rec.to_json().replace('"probe"', '"prob"')
    with pytest.raises(ContractError, match="source 'prob', expected one of"):
        QuarantineRecord.parse(forged)


def test_openapi_checkpoint_is_exactly_checkpoint_summary() -> None:
    """The OpenAPI ``Checkpoint`` schema (rows of listCheckpoints, the answer of pin and
    unpin) names exactly CheckpointSummary's keys, requires every one, and its status
    enum is CheckpointStatus."""
    schema = openapi_document()["components"]["schemas"]["Checkpoint"]
    keys = set(CheckpointSummary.__annotations__)
    assert set(schema["properties"]) == keys
    assert set(schema["required"]) == set(CheckpointSummary.__required_keys__) == keys
    assert schema["properties"]["status"]["items"]["enum"] == list(get_args(CheckpointStatus))


async def test_admin_api_and_ckpt_ls_send_one_checkpoint_summary(
        redis_server: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """For the same store, ``GET /admin/checkpoints/{store}`` and ``trainguard ckpt ls
    --json`` send equal rows with exactly CheckpointSummary's keys: status and pinned
    on both sides, a pinned checkpoint labelled pinned on both."""
    root = tmp_path / "ck"
    save_checkpoints(str(root), [1, 2], {0: "1-1"})
    CheckpointStore(str(root)).pin(2)
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        resp = await client.get("/admin/checkpoints/main")
        assert resp.status == 200
        api = (await resp.json())["checkpoints"]
    assert main(["ckpt", "ls", str(root), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert [set(row) for row in api] == [set(CheckpointSummary.__annotations__)] * 2
    assert cli == api
    assert [(r["step"], r["pinned"], r["status"]) for r in api] == [
        (1, False, ["committed"]), (2, True, ["committed", "pinned"])]
    assert all(r["world_size"] == 1 for r in api)
