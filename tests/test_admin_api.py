"""Admin API over a real redis-server: datasets, groups, seek, auth and error shape."""

from __future__ import annotations

import pytest

from ingest_service import redis_client as ingest_redis
from ingest_service.service.admin import AdminConfig
from tests.admin_helpers import AUTH, admin_client, make_dataset, make_group
from trainguard.core import streams


def _is_error(body: object, code: str) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and body["error"]["code"] == code
        and isinstance(body["error"]["message"], str)
        and len(body["error"]["message"]) > 10
    )


async def test_list_and_show_dataset(any_redis):
    """List and show report exactly what Redis holds: per-partition length, first and
    last ID, producer position from the last ID, paused flag, dead-letter count."""
    r = ingest_redis.client(any_redis.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await r.sadd(streams.paused_key("toy"), "1")
    async with admin_client(any_redis.url) as client:
        resp = await client.get("/admin/datasets")
        assert resp.status == 200
        (listed,) = (await resp.json())["datasets"]
        assert (listed["name"], listed["partitions"], listed["length"]) == ("toy", 2, 10)
        assert (listed["paused"], listed["dead_letters"]) == (1, 1)

        resp = await client.get("/admin/datasets/toy")
        assert resp.status == 200
        body = await resp.json()
        assert body["spec"]["partitions"] == 2
        assert body["dead_letters"] == 1
        p0, p1 = body["partitions"]
        assert (p0["length"], p0["first_id"], p0["last_id"]) == (5, "1-0", "1-4")
        assert p0["producer_position"] == {"epoch": 0, "records": 5}
        assert (p0["paused"], p1["paused"]) == (False, True)
        assert p0["bytes"] > 0 and "MEMORY USAGE" in body["bytes_method"]
    await r.aclose()


async def test_groups_report_delivered_committed_lag_pending(any_redis):
    """Per group and partition: last delivered ID, committed offset, lag, pending and
    the consumer that holds the pending entries."""
    r = ingest_redis.client(any_redis.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2)
    await r.xreadgroup("run1", "rank0", {streams.partition_key("toy", 0): ">"}, count=3)
    await r.hset(streams.committed_key("toy", "run1"), mapping={"0": "1-1"})
    async with admin_client(any_redis.url) as client:
        resp = await client.get("/admin/datasets/toy/groups")
        assert resp.status == 200
        (group,) = (await resp.json())["groups"]
        assert group["group"] == "run1"
        p0, p1 = group["partitions"]
        assert (p0["last_delivered_id"], p0["committed"], p0["lag"], p0["pending"]) == (
            "1-2", "1-1", 2, 3)
        assert [c["name"] for c in p0["consumers"]] == ["rank0"]
        assert p0["consumers"][0]["pending"] == 3
        assert (p1["last_delivered_id"], p1["committed"], p1["lag"], p1["pending"]) == (
            "0-0", None, 5, 0)
    await r.aclose()


async def test_seek_earliest_latest_and_ids(any_redis):
    """Seek moves the group's last-delivered ID: latest -> last entry, ids -> exactly
    those, earliest -> the group's retention floor (the lowest safe position)."""
    r = ingest_redis.client(any_redis.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2, floor={0: "1-1", 1: "1-0"})
    key0, key1 = streams.partition_key("toy", 0), streams.partition_key("toy", 1)

    async def delivered() -> tuple[str, str]:
        g0 = (await r.xinfo_groups(key0))[0]["last-delivered-id"].decode()
        g1 = (await r.xinfo_groups(key1))[0]["last-delivered-id"].decode()
        return g0, g1

    async with admin_client(any_redis.url) as client:
        url = "/admin/datasets/toy/groups/run1/seek"
        resp = await client.post(url, json={"to": "latest"}, headers=AUTH)
        assert resp.status == 200
        assert (await resp.json())["offsets"] == {"0": "1-4", "1": "1-4"}
        assert await delivered() == ("1-4", "1-4")

        resp = await client.post(url, json={"ids": {"1": "1-2"}}, headers=AUTH)
        assert resp.status == 200
        assert await delivered() == ("1-4", "1-2")

        resp = await client.post(url, json={"to": "earliest"}, headers=AUTH)
        assert resp.status == 200
        assert await delivered() == ("1-1", "1-0")
    await r.aclose()


async def test_seek_below_floor_is_refused_and_changes_nothing(any_redis):
    """A seek below the group's retention floor, or below entries Redis already
    deleted, is 409 and moves no partition (all targets are checked first, on a
    cluster too, where the move itself goes partition by partition)."""
    redis_server = any_redis
    r = ingest_redis.client(redis_server.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2, floor={0: "1-3"})
    key0, key1 = streams.partition_key("toy", 0), streams.partition_key("toy", 1)
    await r.xgroup_setid(key0, "run1", "1-4")
    await r.xgroup_setid(key1, "run1", "1-4")
    await r.xtrim(key1, minid="1-2", approximate=False)  # deletes 1-0 and 1-1
    async with admin_client(redis_server.url) as client:
        url = "/admin/datasets/toy/groups/run1/seek"
        resp = await client.post(url, json={"ids": {"0": "1-2"}}, headers=AUTH)
        assert resp.status == 409 and _is_error(await resp.json(), "below_floor")
        resp = await client.post(url, json={"ids": {"1": "1-4", "0": "1-2"}}, headers=AUTH)
        assert resp.status == 409
        resp = await client.post(url, json={"ids": {"1": "1-0"}}, headers=AUTH)
        assert resp.status == 409 and "deleted" in (await resp.json())["error"]["message"]
        for key in (key0, key1):
            assert (await r.xinfo_groups(key))[0]["last-delivered-id"] == b"1-4"
        resp = await client.post(url, json={"ids": {"0": "1-3", "1": "1-1"}}, headers=AUTH)
        assert resp.status == 200
    await r.aclose()


async def test_bad_input_is_4xx_with_the_error_shape(redis_target):
    """Unknown dataset/group, bad names, bad IDs, bad partitions, malformed or wrong
    JSON bodies and unknown routes all answer 4xx with {"error": {code, message}}."""
    r = ingest_redis.client(redis_target.url)
    await make_dataset(r, partitions=2, per_partition=3)
    await make_group(r, "toy", "run1", 2)
    seek = "/admin/datasets/toy/groups/run1/seek"
    cases = [
        ("GET", "/admin/datasets/nope", None, 404, "dataset_not_found"),
        ("GET", "/admin/datasets/nope/groups", None, 404, "dataset_not_found"),
        ("GET", "/admin/datasets/b%20ad", None, 400, "bad_name"),
        ("POST", "/admin/datasets/nope/groups/run1/seek", {"to": "latest"}, 404,
         "dataset_not_found"),
        ("POST", "/admin/datasets/toy/groups/ghost/seek", {"to": "latest"}, 404,
         "group_not_found"),
        ("POST", seek, {"ids": {"0": "banana"}}, 400, "bad_id"),
        ("POST", seek, {"ids": {"0": 17}}, 400, "bad_id"),
        ("POST", seek, {"ids": {"7": "1-0"}}, 404, "bad_partition"),  # no such partition
        ("POST", seek, {"ids": {"-1": "1-0"}}, 400, "bad_partition"),
        ("POST", seek, {"ids": {}}, 400, "bad_ids"),
        ("POST", seek, {"to": "middle"}, 400, "bad_target"),
        ("POST", seek, {"to": 3}, 400, "bad_target"),
        ("POST", seek, {}, 400, "bad_target"),
        ("POST", seek, {"to": "latest", "ids": {"0": "1-0"}}, 400, "bad_target"),
        ("POST", seek, [1, 2], 400, "bad_json"),
        ("POST", seek, {"checkpoint": {"store": "none", "step": 1}}, 404, "store_not_found"),
        ("POST", seek, {"checkpoint": {"store": "x", "step": "one"}}, 400, "bad_checkpoint"),
        ("GET", "/admin/nothing-here", None, 404, "not_found"),
        ("PUT", "/admin/datasets", None, 405, "method_not_allowed"),
    ]
    async with admin_client(redis_target.url) as client:
        for method, path, body, status, code in cases:
            resp = await client.request(method, path, json=body, headers=AUTH)
            got = await resp.json()
            assert (resp.status, _is_error(got, code)) == (status, True), (method, path, body, got)
        resp = await client.post(seek, data=b"{not json", headers=AUTH)
        assert resp.status == 400 and _is_error(await resp.json(), "bad_json")
        resp = await client.post(seek, data=b"x" * (2 * 1024 * 1024), headers=AUTH)
        assert resp.status == 413 and "error" in await resp.json()
    await r.aclose()


async def test_mutations_need_the_bearer_token(redis_target):
    """Mutating routes: no header -> 401 (with WWW-Authenticate), wrong token or wrong
    scheme -> 403, and nothing moves; read routes need no token."""
    r = ingest_redis.client(redis_target.url)
    await make_dataset(r, partitions=1, per_partition=3)
    await make_group(r, "toy", "run1", 1)
    seek = "/admin/datasets/toy/groups/run1/seek"
    async with admin_client(redis_target.url) as client:
        resp = await client.post(seek, json={"to": "latest"})
        assert resp.status == 401 and _is_error(await resp.json(), "unauthorized")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        for header in ("Bearer wrong", "Bearer s3cret-token-and-more", "Bearer  "):
            resp = await client.post(seek, json={"to": "latest"},
                                     headers={"Authorization": header})
            assert resp.status in (401, 403), header
        resp = await client.post(seek, json={"to": "latest"},
                                 headers={"Authorization": "Bearer wrong"})
        assert resp.status == 403 and _is_error(await resp.json(), "forbidden")
        resp = await client.post(seek, json={"to": "latest"},
                                 headers={"Authorization": "Basic s3cret-token"})
        assert resp.status == 401
        group = (await r.xinfo_groups(streams.partition_key("toy", 0)))[0]
        assert group["last-delivered-id"] == b"0-0"
        assert (await client.get("/admin/datasets/toy")).status == 200
    await r.aclose()


async def test_without_configured_token_mutations_are_refused(redis_target):
    """No TRAINGUARD_ADMIN_TOKEN: every mutation is 403 mutations_disabled, whatever
    token is sent (refused, not open)."""
    r = ingest_redis.client(redis_target.url)
    await make_dataset(r, partitions=1, per_partition=3)
    await make_group(r, "toy", "run1", 1)
    async with admin_client(redis_target.url, token=None) as client:
        for headers in ({}, AUTH, {"Authorization": "Bearer "}):
            resp = await client.post("/admin/datasets/toy/groups/run1/seek",
                                     json={"to": "latest"}, headers=headers)
            assert resp.status == 403 and _is_error(await resp.json(), "mutations_disabled")
    await r.aclose()


def test_config_from_env_reads_token_and_stores(monkeypatch):
    """The token and the store roots come from the environment; an empty token
    means none (mutations disabled)."""
    monkeypatch.setenv("TRAINGUARD_ADMIN_TOKEN", "")
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_STORES", "a=file:///x, b=file:///y|s3://b/y")
    config = AdminConfig.from_env("redis://127.0.0.1:1/0")
    assert config.token is None
    assert {n: (s.url, s.remote_url) for n, s in config.stores.items()} == {
        "a": ("file:///x", None), "b": ("file:///y", "s3://b/y")}
    monkeypatch.setenv("TRAINGUARD_ADMIN_TOKEN", "a-token-of-24-characters")
    assert AdminConfig.from_env("redis://127.0.0.1:1/0").token == "a-token-of-24-characters"


@pytest.mark.parametrize("token", ["t", "fifteen-chars!!", "   ", " padded-token-of-20 ", "tökén-with-accents"])
def test_blank_or_short_admin_token_refuses_to_start(monkeypatch, token):
    """A guessable admin token is refused when the config is read (the service does not
    start), naming the variable and the minimum length."""
    from ingest_service.errors import TokenConfigError

    monkeypatch.setenv("TRAINGUARD_ADMIN_TOKEN", token)
    with pytest.raises(TokenConfigError, match="TRAINGUARD_ADMIN_TOKEN"):
        AdminConfig.from_env("redis://127.0.0.1:1/0")


def test_service_binds_loopback_unless_told_otherwise():
    """`trainguard serve` (which serves the admin API) binds 127.0.0.1 by default;
    another address needs an explicit --host."""
    from trainguard.ops.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).host == "127.0.0.1"
    assert parser.parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"


async def test_seek_earliest_after_trim_reads_exactly_what_is_left(redis_target):
    """After trimming, 'earliest' is the ID just below the first entry left, so the
    group's next read starts at exactly that entry: within an epoch (1-2 -> 1-1) and
    across an epoch boundary (2-0 -> 1-<max>)."""
    r = ingest_redis.client(redis_target.url)
    await make_dataset(r, partitions=2, per_partition=4)
    key0, key1 = streams.partition_key("toy", 0), streams.partition_key("toy", 1)
    await r.xadd(key1, streams.encode_record({"epoch": 1}), id=streams.make_id(1, 0))
    await make_group(r, "toy", "run1", 2)
    await r.xtrim(key0, minid="1-2", approximate=False)
    await r.xtrim(key1, minid="2-0", approximate=False)
    async with admin_client(redis_target.url) as client:
        resp = await client.post("/admin/datasets/toy/groups/run1/seek",
                                 json={"to": "earliest"}, headers=AUTH)
        assert resp.status == 200
        assert (await resp.json())["offsets"] == {"0": "1-1", "1": f"1-{2**64 - 1}"}
    got = [await r.xreadgroup("run1", "c", {key: ">"}, count=1) for key in (key0, key1)]
    assert {k.decode(): entries[0][0] for ((k, entries),) in got} == {key0: b"1-2", key1: b"2-0"}
    await r.aclose()


async def test_seek_refuses_a_group_with_an_active_consumer_unless_forced(redis_target):
    """A consumer that just read (a running trainer) makes a seek 409 group_active
    and nothing moves; with "force": true the seek goes through; a non-boolean force
    is 400."""
    r = ingest_redis.client(redis_target.url)
    await make_dataset(r, partitions=2, per_partition=4)
    await make_group(r, "toy", "run1", 2)
    key1 = streams.partition_key("toy", 1)
    await r.xreadgroup("run1", "rank0", {key1: ">"}, count=1)
    url = "/admin/datasets/toy/groups/run1/seek"
    async with admin_client(redis_target.url) as client:
        resp = await client.post(url, json={"to": "latest"}, headers=AUTH)
        body = await resp.json()
        assert resp.status == 409 and body["error"]["code"] == "group_active"
        assert "rank0" in body["error"]["message"]
        assert (await r.xinfo_groups(key1))[0]["last-delivered-id"] == b"1-0"
        resp = await client.post(url, json={"to": "latest", "force": "yes"}, headers=AUTH)
        assert resp.status == 400
        resp = await client.post(url, json={"force": True}, headers=AUTH)
        assert resp.status == 400
        resp = await client.post(url, json={"to": "latest", "force": True}, headers=AUTH)
        assert resp.status == 200
        assert (await r.xinfo_groups(key1))[0]["last-delivered-id"] == b"1-3"
    await r.aclose()
