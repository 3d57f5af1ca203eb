"""The OpenAPI document matches the router, and fuzzing every operation from it
against a real running server (real Redis, real checkpoint store) yields no 5xx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ingest_service.service.admin import AdminConfig
from ingest_service.service.admin_checkpoints import StoreRoot
from ingest_service.service.openapi import openapi_document
from tests.admin_helpers import TOKEN, ThreadedServer, make_dataset, make_group, service_app
from tests.servers import RedisServer

PUSH_TOKEN = "fuzz-producer-token-0123"

_METHODS = {"get", "post", "put", "delete", "patch"}


def _routed(app: web.Application) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        info = route.get_info()
        path = info.get("path") or info.get("formatter")
        # aiohttp adds a HEAD route beside every GET; it is implied by the GET.
        if route.method == "HEAD" or path is None:
            continue
        out.add((route.method.lower(), path))
    return out


def _documented(doc: dict) -> set[tuple[str, str]]:
    return {
        (method, path)
        for path, ops in doc["paths"].items()
        for method in ops
        if method in _METHODS
    }


def test_every_route_is_documented_and_vice_versa(tmp_path):
    """The set of (method, path) in /openapi.json equals the app's router, ingest
    routes included: no undocumented route, no documented route that 404s."""
    app = service_app(AdminConfig("redis://127.0.0.1:1/0", TOKEN, {}))
    assert _routed(app) == _documented(openapi_document())


def test_document_is_valid_openapi():
    """schemathesis can load the document and finds one operation per documented
    (method, path); every operation has an operationId and a 2xx response."""
    doc = openapi_document()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {(op.method.lower(), op.path) for op in operations} == _documented(doc)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["operationId"], (method, path)
            assert any(code.startswith("2") for code in op["responses"]), (method, path)


@pytest.fixture(scope="module")
def live_service(tmp_path_factory) -> Iterator[str]:
    """A real server on a free port with a dataset, a group and two checkpoints."""
    from tests.admin_helpers import save_checkpoints

    tmp = tmp_path_factory.mktemp("fuzz")
    redis_server = RedisServer(tmp / "redis").start()
    ckpt = tmp / "ckpt"

    async def seed() -> None:
        from ingest_service.datasets import create_dataset
        from trainguard.core import streams

        r = aioredis.Redis.from_url(redis_server.url)
        await make_dataset(r, "toy", partitions=2, per_partition=5)
        await make_group(r, "toy", "run1", 2, floor={0: "1-1", 1: "1-1"})
        await create_dataset(r, streams.DatasetSpec(name="rl", partitions=2, format="push"))
        await r.aclose()

    asyncio.run(seed())
    save_checkpoints(str(ckpt), [1, 2, 3], {0: "1-2", 1: "1-3"})
    config = AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", str(ckpt))})
    server = ThreadedServer(service_app(config, f"{PUSH_TOKEN}:*:*")).start()
    try:
        yield server.url
    finally:
        server.stop()
        redis_server.kill()


# Push bodies are JSON Lines (text) or msgpack (bytes): send them as the built-in
# text and binary serializers would.
schemathesis.serializer.alias("application/x-ndjson", "text/plain")
schemathesis.serializer.alias("application/msgpack", "application/octet-stream")
schema = schemathesis.openapi.from_dict(openapi_document())


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_no_server_errors(case, live_service):
    """Generated requests (valid and invalid, with the right token so mutations run
    deep) never get a 5xx, and every 4xx has the JSON error shape."""
    response = case.call(base_url=live_service, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    assert response.status_code < 500, (case.method, case.formatted_path, response.text)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and {"code", "message"} <= set(body["error"])


def _tokens(case: schemathesis.Case) -> dict[str, str]:
    token = PUSH_TOKEN if case.operation.path.startswith("/v1/") else TOKEN
    return {"Authorization": f"Bearer {token}"}


# Schemathesis' own checks of the document against the server: 5xx, status codes and
# content types the document does not list, response bodies and headers off their
# schemas, 405 without Allow (unsupported_method), and valid requests refused
# (positive_data_acceptance: a request the schema allows must not get 400).
_STATEFUL_STEPS = 6


@pytest.mark.parametrize("with_tokens", [True, False], ids=["tokens", "no-tokens"])
def test_stateful_links_find_no_server_errors_and_no_spec_violations(live_service, with_tokens):
    """Sequences of calls chained by the document's links (a dataset listed, then
    shown, its groups listed, one sought; stores, checkpoints, verify, pin; a push,
    then its retry), with the right tokens and without any: 0 failures of every
    schemathesis check."""
    stateful = schemathesis.openapi.from_dict(openapi_document())
    stateful.config.update(base_url=live_service)

    class Workflow(stateful.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case):  # type: ignore[no-untyped-def]
            return {"headers": _tokens(case) if with_tokens else {}, "timeout": 30}

    run_state_machine_as_test(Workflow, settings=settings(
        max_examples=12, stateful_step_count=_STATEFUL_STEPS, deadline=None,
        suppress_health_check=list(HealthCheck), database=None))


def test_openapi_served(live_service):
    """/openapi.json serves the document."""
    got = requests.get(f"{live_service}/openapi.json", timeout=10)
    assert got.status_code == 200 and got.json() == openapi_document()
