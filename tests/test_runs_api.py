"""The operator's JSON routes against the real service and a real Redis: the dataset
detail shows names and figures (no source path, no directories), throughput is
sampled into the ring and Prometheus, run lookups fail clearly, and GPU health comes
from a real probe daemon's metrics (over the allowed fake NVML)."""

from __future__ import annotations

import asyncio
import re
from itertools import pairwise

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from ingest_service.datasets import create_dataset
from ingest_service.inspection import dataset_groups, show_dataset
from ingest_service.service.admin import AdminConfig
from ingest_service.service.lag import fill_lag
from tests._fake_nvml import FakeGpu, FakeNvml
from tests.admin_helpers import TOKEN, make_dataset, make_group, service_app
from tests.servers import free_port
from trainer_client.health import HealthMonitor, HealthProbe
from trainguard.core import streams
from trainguard.ops.probe import ProbeServer


async def _until(check, what: str, tries: int = 200):  # type: ignore[no-untyped-def]
    for _ in range(tries):
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"never: {what}")


async def test_dataset_detail_names_and_figures_throughput_sampled(redis_server) -> None:
    """The detail carries no source URL and no directory of a dead letter's position;
    records appended while the service runs show up as a produced rate in the ring,
    and the total as a Prometheus gauge."""
    r = aioredis.Redis.from_url(redis_server.url)
    await make_dataset(r, "toy", partitions=2, per_partition=5)
    await r.xadd(streams.dlq_key("toy"), streams.encode_dead_letter(
        "oversized", "s3://key:secret@bucket/private/dir/part-7.jsonl:12", b"x" * 40))
    app = service_app(AdminConfig(redis_server.url, TOKEN, {}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        got = await client.get("/admin/datasets/toy/detail")
        text = await got.text()
        assert got.status == 200
        assert "secret" not in text and "memory://" not in text and "private" not in text
        body = await got.json()
        assert set(body["spec"]) >= {"name", "partitions", "format"}
        assert "source" not in body["spec"] and "options" not in body["spec"]
        assert [(d["reason"], d["position"], d["size"]) for d in body["dead_letters"]["newest"]] \
            == [("oversized", "part-7.jsonl:12", 40), ("undecodable", "x.jsonl:99", 1)]
        assert body["dead_letters"]["count"] == 2

        for i in range(5, 25):  # 20 more records in partition 0 while the sampler runs
            await r.xadd(streams.partition_key("toy", 0), {b"d": b"1"},
                         id=streams.make_id(0, i))

        async def produced() -> list:
            series = (await (await client.get("/admin/datasets/toy/detail")).json())[
                "throughput"]
            return [s for s in series if s["produced"] == 30]

        await _until(produced, "the ring sees all 30 records")
        series = (await (await client.get("/admin/datasets/toy/detail")).json())["throughput"]
        # Each sample's rate covers the time since the one before it.
        added = sum(b["produced_per_s"] * (b["at"] - a["at"]) for a, b in pairwise(series))
        assert added == pytest.approx(series[-1]["produced"] - series[0]["produced"])
        metrics = await (await client.get("/metrics")).text()
        assert re.search(r'^trainguard_dataset_produced_entries\{dataset="toy"\} 30\.0$',
                         metrics, re.M)
    await r.aclose()


async def test_run_lookups_fail_clearly(redis_server) -> None:
    """An unknown run is 404, a run name used on two datasets is 409 until ?dataset=
    says which, a bad name is 400; all in the admin error shape."""
    r = aioredis.Redis.from_url(redis_server.url)
    for name in ("a", "b"):
        await make_dataset(r, name, partitions=1, per_partition=3)
        await make_group(r, name, "run1", 1)
    app = service_app(AdminConfig(redis_server.url, TOKEN, {}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for path, status, code in (("/admin/runs/nope", 404, "run_not_found"),
                                   ("/admin/runs/run1", 409, "ambiguous_run"),
                                   ("/admin/runs/run1?dataset=a%20b", 400, "bad_name")):
            got = await client.get(path)
            assert got.status == status, path
            assert (await got.json())["error"]["code"] == code
        got = await client.get("/admin/runs/run1?dataset=b")
        body = await got.json()
        assert got.status == 200 and (body["dataset"], body["run"]) == ("b", "run1")
        assert body["store"] is None and body["checkpoints"] == [] and body["advice"] is None
        assert body["group"]["lag"] == 3  # nothing read yet: every record
        runs = (await (await client.get("/admin/runs")).json())["runs"]
        assert sorted((x["dataset"], x["run"], x["lag"]) for x in runs) == [
            ("a", "run1", 3), ("b", "run1", 3)]
    await r.aclose()


async def test_gpu_health_from_probe_metrics(redis_server, monkeypatch) -> None:
    """Two nodes: one probe daemon with a GPU at 90 C (WARN), one that does not
    answer (UNREACHABLE). Neither URL appears in the answer."""
    gpu = FakeGpu(uuid="GPU-a", temperature_c=90)
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])))
    monitor.probe_now()
    probe = ProbeServer(monitor, "127.0.0.1", 0).start()
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TRAINGUARD_PROBES", f"node-a={probe.url},node-b={dead}")
    try:
        app = service_app(AdminConfig(redis_server.url, TOKEN, {}))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            got = await client.get("/admin/health")
            text = await got.text()
            nodes = (await got.json())["nodes"]
    finally:
        probe.stop()
    assert probe.url not in text and dead not in text and "127.0.0.1" not in text
    a, b = nodes
    assert (a["node"], a["status"], a["no_gpu"]) == ("node-a", "WARN", False)
    (g,) = a["gpus"]
    assert (g["gpu"], g["status"], g["readings"]["temperature_celsius"]) == (0, "WARN", 90)
    assert g["problems"] == ["temperature: WARN"]
    assert (b["node"], b["status"], b["gpus"]) == ("node-b", "UNREACHABLE", [])


async def test_lag_from_ids_across_epochs_after_setid(redis_server) -> None:
    """After XGROUP SETID Redis reports no lag; the service counts it from the IDs,
    across epochs of different lengths, and it equals the entries after the group's
    position (XRANGE), trimmed partitions included."""
    r = aioredis.Redis.from_url(redis_server.url)
    spec = streams.DatasetSpec(name="ep", partitions=1, source="memory://x", epochs=3)
    await create_dataset(r, spec)
    key = streams.partition_key("ep", 0)
    for epoch, n in ((0, 7), (1, 5), (2, 9)):
        for i in range(n):
            await r.xadd(key, {b"d": b"1"}, id=streams.make_id(epoch, i))
    await r.xgroup_create(key, "g", id="0-0")
    await r.sadd(streams.groups_key("ep"), "g")
    for position, trim in (("0-0", None), ("1-3", None), ("2-4", "1-5"), ("3-2", "3-0")):
        if trim:
            await r.xtrim(key, minid=trim)
        await r.xgroup_setid(key, "g", position)
        (group,) = await dataset_groups(r, "ep")
        # Redis cannot tell after a SETID to anywhere but the start.
        assert (group["partitions"][0]["lag"] is None) == (position != "0-0")
        info = await show_dataset(r, "ep")
        await fill_lag(r, spec, group["partitions"],
                       {0: info["partitions"][0]["last_generated_id"]})
        row = group["partitions"][0]
        # Entries after the position, counted from the full history (7 + 5 + 9).
        epoch, index = ((-1, -1) if position == "0-0" else streams.id_epoch_index(position))
        counts = (7, 5, 9)
        expected = sum(counts[epoch + 1:]) + (counts[epoch] - index - 1 if epoch >= 0 else 0)
        source = "redis" if position == "0-0" else "ids"
        assert (row["lag"], row["lag_from"]) == (expected, source), position
        if not trim:
            assert row["lag"] == len(await r.xrange(key, min=f"({position}"))
    await r.aclose()
