"""The admin API's read side at the edge: listings cost what changed, nothing private
reaches an anonymous reader (or a log line), reads queue rather than fail, and one bad
part (a store, a probe, a forged manifest) shows as such while the rest still answers.
Real service, Redis, files and HTTP throughout."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import fsspec
import pytest
import redis.asyncio as aioredis
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fsspec.implementations.local import LocalFileSystem

from checkpoint_store import CheckpointStore
from checkpoint_store.manifest import encode_manifest
from ingest_service.datasets import create_dataset
from ingest_service.service.admin import AdminConfig
from ingest_service.service.admin_checkpoints import StoreRoot, parse_store_roots
from tests.admin_helpers import AUTH, TOKEN, admin_client, make_dataset, service_app
from trainguard.core import streams
from trainguard.core.urls import redact_text, redact_url

READ_TOKEN = "a-read-token-for-the-tests-0123"


class CountingFS(LocalFileSystem):
    """Local files under the ``countfile://`` protocol, counting each file read."""

    protocol = ("countfile",)
    root_marker = "/"
    reads: Counter[str] = Counter()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return LocalFileSystem._strip_protocol(path.removeprefix("countfile://"))

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        CountingFS.reads[str(path)] += 1
        return super().cat_file(path, start, end, **kw)


fsspec.register_implementation("countfile", CountingFS, clobber=True)


class GatedFS(CountingFS):
    """Counting local files under ``gatedfile://``; reading the file named ``gate``
    sets ``entered`` and waits for ``release`` (a slow disk, held for the test)."""

    protocol = ("gatedfile",)
    gate = ""
    entered = threading.Event()
    release = threading.Event()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return LocalFileSystem._strip_protocol(str(path).removeprefix("gatedfile://"))

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        if GatedFS.gate and str(path).endswith(GatedFS.gate):
            GatedFS.entered.set()
            GatedFS.release.wait(60)
        return super().cat_file(path, start, end, **kw)


fsspec.register_implementation("gatedfile", GatedFS, clobber=True)


async def _until(check: Any, what: str) -> None:
    for _ in range(600):  # a bound on polls, not a deadline asserted
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def _save_runs(url: str, runs: dict[str, list[int]], *, dataset: str = "toy",
               extra: dict[str, Any] | None = None) -> None:
    store = CheckpointStore(url, keep_last=1000)
    state = {"w": torch.arange(6, dtype=torch.float32)}
    for run, steps in runs.items():
        for step in steps:
            tg = {"dataset": dataset, "run": run, "offsets": {"0": f"1-{step}"}}
            store.save(state, step=step, extra={"trainguard": tg, **(extra or {})},
                       blocking=True)
    store.close()


def _manifest_reads() -> int:
    return sum(n for path, n in CountingFS.reads.items() if "/manifests/" in path)


async def test_a_repeated_runs_request_reads_no_manifest_and_a_new_one_reads_one(
        redis_server, tmp_path: Path) -> None:
    """Manifests are immutable: the first /admin/runs reads each manifest once, a
    second identical request reads none (counted at the filesystem), and after one
    more save exactly that one manifest is read; the answers are the same runs."""
    root = tmp_path / "ck"
    url = f"countfile://{root}"  # the service reads through the counting filesystem
    _save_runs(str(root), {"a": [1, 2, 3], "b": [4, 5], "c": [6]})
    CountingFS.reads.clear()
    app = service_app(AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", url)}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        first = await (await client.get("/admin/runs")).json()
        assert _manifest_reads() == 6
        second = await (await client.get("/admin/runs")).json()
        assert _manifest_reads() == 6 and second == first
        assert [(r["run"], r["checkpoints"]) for r in first["runs"]] == [
            ("a", 3), ("b", 2), ("c", 1)]
        _save_runs(str(root), {"c": [7]})
        CountingFS.reads.clear()
        third = await (await client.get("/admin/runs")).json()
        assert _manifest_reads() == 1
        assert [(r["run"], r["checkpoints"]) for r in third["runs"]] == [
            ("a", 3), ("b", 2), ("c", 2)]


async def test_runs_and_checkpoints_are_paginated(redis_server, tmp_path: Path) -> None:
    """?offset=&limit= select rows of /admin/runs and of a store's checkpoints, the
    answer gives the total; a limit out of range is a 400."""
    root = tmp_path / "ck"
    _save_runs(str(root), {"a": [1, 2], "b": [3], "c": [4]})
    app = service_app(AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", str(root))}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        page = await (await client.get("/admin/runs?offset=1&limit=1")).json()
        assert [r["run"] for r in page["runs"]] == ["b"] and page["total"] == 3
        page = await (await client.get("/admin/checkpoints/main?offset=2&limit=5")).json()
        assert [r["step"] for r in page["checkpoints"]] == [3, 4] and page["total"] == 4
        resp = await client.get("/admin/runs?limit=100000")
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "bad_limit"


async def test_one_unreadable_store_leaves_the_other_stores_runs(redis_server,
                                                                 tmp_path: Path) -> None:
    """A store root that cannot be listed (a file where the directory should be) is
    named in store_errors; /admin/runs still answers 200 with the good store's runs,
    and neither the answer nor /readyz quotes the broken root's path."""
    good = tmp_path / "good"
    _save_runs(str(good), {"a": [1]})
    broken = tmp_path / "a-file"
    broken.write_text("not a directory")
    roots = {"good": StoreRoot("good", str(good)), "broken": StoreRoot("broken", str(broken))}
    app = service_app(AdminConfig(redis_server.url, TOKEN, roots))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.get("/admin/runs")
        text = await resp.text()
        assert resp.status == 200, text
        body = json.loads(text)
        assert [r["run"] for r in body["runs"]] == ["a"]
        assert set(body["store_errors"]) == {"broken"}
        ready = await client.get("/readyz")
        ready_text = await ready.text()
        assert ready.status == 503 and "broken" in ready_text
        for t in (text, ready_text):
            assert str(tmp_path) not in t and "a-file" not in t


def test_redaction_covers_raw_at_signs_unschemed_userinfo_and_secret_parameters() -> None:
    """A raw '@' in a password, botocore's unschemed KEY:SECRET@bucket, an AWS secret
    holding '/', and sig/auth/jwt/pw parameters leave no secret in the text; every
    query value of a configured URL is hidden."""
    cases = {
        "redis://:hunt@er2@cache:6379/0": "hunt",
        "redis://u:er2@x@cache:6379/0": "er2",
        'Invalid bucket name "AKIAKEY:wJalr/XUtn+FEMI@bucket": must match': "wJalr",
        "s3://AKIAKEY:wJalr/XUtn@bucket/run failed": "wJalr",
        "GET https://h/x?sig=S1&auth=S2&jwt=S3&pw=S4&ok=1": "S",
    }
    for text, secret in cases.items():
        out = redact_text(text)
        assert secret not in out, (text, out)
    assert redact_url("https://hf.co/tok.json?revision=abc&x=1") == \
        "https://hf.co/tok.json?revision=***&x=***"


def test_a_store_url_with_credentials_is_refused_without_quoting_them() -> None:
    """user:password@ in a store URL is refused at configuration (the message says
    where credentials go instead) and never quotes the password."""
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID") as info:
        parse_store_roots("main=s3://AKIAKEY:wJalr/XUtn@bucket/run")
    assert "wJalr" not in str(info.value)


async def test_private_fields_need_a_token(redis_server, tmp_path: Path) -> None:
    """Anonymous: a dataset's options (a tokenizer URL with ?token=) are hidden and a
    checkpoint is its summary row only (no extra, tensors or random states); with the
    admin token the options are shown redacted and the manifest whole."""
    r = aioredis.Redis.from_url(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(
        name="tok", source="memory://x.txt", format="text",
        options={"tokenizer": "https://hf.co/t/tokenizer.json?token=hf_SECRET"}))
    root = tmp_path / "ck"
    _save_runs(str(root), {"a": [1]}, extra={"wandb_api_key": "WANDB_SECRET"})
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        for path in ("/admin/datasets", "/admin/datasets/tok", "/admin/checkpoints/main/1",
                     "/admin/checkpoints/main"):
            text = await (await client.get(path)).text()
            assert "SECRET" not in text and "hf.co" not in text, (path, text)
        row = await (await client.get("/admin/checkpoints/main/1")).json()
        assert not {"extra", "tensors", "arrays"} & set(row) and row["step"] == 1
        admin = await (await client.get("/admin/datasets/tok", headers=AUTH)).json()
        assert admin["spec"]["options"]["tokenizer"] == \
            "https://hf.co/t/tokenizer.json?token=***"
        full = await (await client.get("/admin/checkpoints/main/1", headers=AUTH)).json()
        assert full["extra"]["wandb_api_key"] == "WANDB_SECRET" and "w" in full["tensors"]
    await r.aclose()


async def test_a_read_token_guards_every_read_route(redis_server, tmp_path: Path) -> None:
    """With TRAINGUARD_READ_TOKEN set, reads without a token are 401, with a wrong one
    403, and with the read token or the admin token 200."""
    r = aioredis.Redis.from_url(redis_server.url)
    await make_dataset(r)
    app = service_app(AdminConfig(redis_server.url, TOKEN, {}, read_token=READ_TOKEN))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for path in ("/admin/datasets", "/admin/datasets/toy/groups", "/admin/runs",
                     "/openapi.json"):
            assert (await client.get(path)).status == 401, path
            bad = {"Authorization": "Bearer wrong-token-of-enough-length"}
            assert (await client.get(path, headers=bad)).status == 403, path
            read = {"Authorization": f"Bearer {READ_TOKEN}"}
            assert (await client.get(path, headers=read)).status == 200, path
            assert (await client.get(path, headers=AUTH)).status == 200, path
        assert (await client.get("/healthz")).status == 200
    await r.aclose()


async def test_a_burst_of_reads_queues_for_connections_instead_of_failing(
        redis_server) -> None:
    """400 concurrent anonymous reads on 400 connections (four times redis-py's
    default pool): every one answers 200; none is a 503."""
    import aiohttp

    r = aioredis.Redis.from_url(redis_server.url)
    await make_dataset(r)
    app = service_app(AdminConfig(redis_server.url, TOKEN, {}))
    async with TestClient(TestServer(app, host="127.0.0.1"),
                          connector=aiohttp.TCPConnector(limit=0)) as client:
        async def one() -> int:
            async with client.get("/admin/datasets/toy/groups") as resp:
                await resp.read()
                return resp.status
        statuses = Counter(await asyncio.gather(*(one() for _ in range(400))))
    assert statuses == Counter({200: 400})
    await r.aclose()


async def _probe_app(body: bytes) -> web.Application:
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    app.router.add_get("/metrics", metrics)
    return app


async def test_a_probe_with_infinite_figures_or_a_huge_body_leaves_the_others(
        redis_server, monkeypatch) -> None:
    """A probe reporting +Inf and NaN shows its node as UNKNOWN with null readings, one
    sending 2 MiB shows UNREACHABLE, a sound one shows OK: /admin/health is 200 JSON."""
    inf = (b"trainguard_node_health_status +Inf\n"
           b'trainguard_gpu_check_status{gpu="0",signal="temperature"} NaN\n'
           b'trainguard_gpu_temperature_celsius{gpu="0"} +Inf\n')
    ok = b'trainguard_node_health_status 0\ntrainguard_gpu_temperature_celsius{gpu="0"} 40\n'
    huge = b"# " + b"x" * (2 << 20) + b"\n"
    servers = [TestServer(await _probe_app(b), host="127.0.0.1") for b in (inf, huge, ok)]
    for s in servers:
        await s.start_server()
    monkeypatch.setenv("TRAINGUARD_PROBES", ",".join(
        f"{n}=http://127.0.0.1:{s.port}" for n, s in zip(("inf", "huge", "ok"), servers)))
    try:
        app = service_app(AdminConfig(redis_server.url, TOKEN, {}))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.get("/admin/health")
            assert resp.status == 200
            nodes = {n["node"]: n for n in json.loads(await resp.text())["nodes"]}
    finally:
        for s in servers:
            await s.close()
    assert nodes["inf"]["status"] == "UNKNOWN"
    assert nodes["inf"]["gpus"][0]["readings"]["temperature_celsius"] is None
    assert nodes["huge"]["status"] == "UNREACHABLE"
    assert nodes["ok"]["status"] == "OK"


async def test_run_names_from_manifests_are_checked_like_every_name(
        redis_server, tmp_path: Path) -> None:
    """A manifest whose session record names a run with a terminal escape is not a
    run: /admin/runs lists only the well-named one."""
    root = tmp_path / "ck"
    _save_runs(str(root), {"good": [1], "evil\x1b[2J": [2]})
    app = service_app(AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", str(root))}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        body = await (await client.get("/admin/runs")).json()
    assert [r["run"] for r in body["runs"]] == ["good"]


def test_cli_tables_escape_control_characters() -> None:
    """A cell holding an escape sequence prints as its escaped text."""
    from trainguard.ops.output import table

    out = table([["evil\x1b[2J", None]], ["run", "lag"])
    assert "\x1b" not in out and "evil\\x1b[2J" in out


async def test_verify_of_a_forged_manifest_is_an_answer_not_a_500(
        redis_server, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Step 2's manifest rewritten with chunk_bytes 0 and a valid checksum: the store
    no longer lists it, /verify of it is a 404 (no such valid checkpoint) and of step
    1 valid; nothing answers 5xx."""
    root = tmp_path / "ck"
    _save_runs(str(root), {"a": [1, 2]})
    (path,) = [p for p in (root / "manifests").iterdir()
               if json.loads(p.read_bytes())["step"] == 2]
    doc = json.loads(path.read_bytes())
    for meta in doc["arrays"].values():
        meta["chunk_bytes"] = 0
    raw = encode_manifest(step=2, uid=doc["uid"], created_at=doc["created_at"],
                          parent=doc["parent"], world_size=1, extra=doc["extra"],
                          arrays=doc["arrays"], tensors=doc["tensors"],
                          state=base64.b64decode(doc["state"]["base64"]))
    path.unlink()
    path.write_bytes(raw)
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        with caplog.at_level(logging.WARNING):
            two = await client.get("/admin/checkpoints/main/2/verify")
            one = await (await client.get("/admin/checkpoints/main/1/verify")).json()
            listed = await (await client.get("/admin/checkpoints/main")).json()
    assert two.status == 404 and one["valid"] is True
    assert [r["step"] for r in listed["checkpoints"]] == [1]


async def test_an_abandoned_runs_request_stops_reading_manifests(
        redis_server, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A client asks for /admin/runs and goes away while the service reads the second
    of six manifests: the catalog work stops there (manifests three to six are never
    read), and the next request reads only those four, each once."""
    root = tmp_path / "ck"
    _save_runs(str(root), {"a": [1, 2, 3, 4, 5, 6]})
    names = sorted(p.name for p in (root / "manifests").iterdir())
    GatedFS.gate, GatedFS.entered, GatedFS.release = names[1], threading.Event(), \
        threading.Event()
    CountingFS.reads.clear()
    caplog.set_level(logging.INFO, logger="ingest_service.service.catalog")
    roots = {"main": StoreRoot("main", f"gatedfile://{root}")}
    app = service_app(AdminConfig(redis_server.url, TOKEN, roots))
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            session = aiohttp.ClientSession()
            request = asyncio.ensure_future(session.get(client.make_url("/admin/runs")))
            await _until(GatedFS.entered.is_set, "the service reads the second manifest")
            request.cancel()
            await session.close()
            await _until(lambda: "every request waiting for it has gone" in caplog.text,
                         "the service sees its client gone")
            GatedFS.release.set()
            await _until(lambda: "stopped early" in caplog.text, "the work stops")
            read = {Path(p).name for p in CountingFS.reads if "/manifests/" in p}
            assert read == set(names[:2])
            body = await (await client.get("/admin/runs")).json()
            assert [(r["run"], r["checkpoints"]) for r in body["runs"]] == [("a", 6)]
            assert {Path(p).name: n for p, n in CountingFS.reads.items()
                    if "/manifests/" in p} == dict.fromkeys(names, 1)
    finally:
        GatedFS.release.set()
        GatedFS.gate = ""


def test_the_cli_refuses_a_store_url_with_credentials_and_never_prints_them(capsys) -> None:
    """`trainguard ckpt ls s3://KEY:SECRET@bucket/run` is a usage error (exit 2) that
    says where credentials go, and neither stdout nor stderr holds the secret."""
    from trainguard.ops.cli import main

    code = main(["ckpt", "ls", "s3://AKIAKEY:wJalr/XUtn@bucket/run"])
    out = capsys.readouterr()
    assert code == 2 and "AWS_ACCESS_KEY_ID" in out.err
    assert "wJalr" not in out.out + out.err


def test_runs_ls_names_an_unreadable_store_and_lists_the_others(
        redis_server, tmp_path: Path, capsys) -> None:
    """`trainguard runs ls` with one store that cannot be read: the good store's runs
    are listed (exit 0) and stderr names the bad store, without its path."""
    from trainguard.ops.cli import main

    good = tmp_path / "good"
    _save_runs(str(good), {"a": [1]})
    broken = tmp_path / "a-file"
    broken.write_text("not a directory")
    code = main(["runs", "ls", "--json", "--redis-url", redis_server.url,
                 "--stores", f"good={good},broken={broken}"])
    out = capsys.readouterr()
    assert code == 0 and [r["run"] for r in json.loads(out.out)] == ["a"]
    assert "broken" in out.err and str(tmp_path) not in out.err


async def test_the_largest_offset_the_spec_allows_is_accepted(redis_server, tmp_path: Path) -> None:
    """The bounds of ?offset= are the spec's, both ends included: offset=1000000000 (its
    maximum, 10 digits) answers 200 with an empty page and the total (it was a 400
    "expected an integer from 0 to 1000000000": the flake of the stateful schemathesis
    test, whenever it drew the maximum), and one past it is a 400 bad_offset."""
    root = tmp_path / "ck"
    _save_runs(str(root), {"a": [1, 2]})
    app = service_app(AdminConfig(redis_server.url, TOKEN, {"main": StoreRoot("main", str(root))}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for path, rows, total in (("/admin/runs", "runs", 1),
                                  ("/admin/checkpoints/main", "checkpoints", 2)):
            resp = await client.get(f"{path}?offset=1000000000")
            assert resp.status == 200, await resp.text()
            body = await resp.json()
            assert body[rows] == [] and body["total"] == total
            resp = await client.get(f"{path}?offset=1000000001")
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "bad_offset"
