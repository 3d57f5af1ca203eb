"""Admin API over real checkpoint stores on tmp dirs: list with status, show, verify,
pin/unpin, delete refusals, seek to a checkpoint's offsets."""

from __future__ import annotations

import os
from pathlib import Path

import redis.asyncio as aioredis
import torch

from checkpoint_store import CheckpointStore
from tests.admin_helpers import AUTH, admin_client, make_dataset, make_group, save_checkpoints
from trainguard.core import streams


def _corrupt_newest_chunk(root: Path) -> None:
    """Flip bytes in a data chunk of the newest checkpoint (its CRC no longer holds)."""
    newest = CheckpointStore(str(root)).latest()
    assert newest is not None
    chunks = [p for p in (root / newest.data_dir).rglob("*") if p.is_file()
              and p.name[0].isdigit()]
    assert chunks
    data = bytearray(chunks[0].read_bytes())
    data[-1] ^= 0xFF
    chunks[0].write_bytes(bytes(data))


async def test_list_show_verify(redis_server, tmp_path):
    """List gives step, time, size and status per checkpoint, oldest first; show gives
    an anonymous reader the list row only (names and figures) and a token holder the
    manifest with the offsets; verify says valid, and invalid after damage."""
    root = tmp_path / "ck"
    save_checkpoints(str(root), [10, 20], {0: "1-4", 1: "1-2"})
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        resp = await client.get("/admin/checkpoints")
        assert (await resp.json())["stores"][0]["name"] == "main"
        resp = await client.get("/admin/checkpoints/main")
        assert resp.status == 200
        rows = (await resp.json())["checkpoints"]
        assert [r["step"] for r in rows] == [10, 20]
        assert all(r["status"] == ["committed"] and r["nbytes"] > 0 and r["created_at"] > 0
                   for r in rows)
        resp = await client.get("/admin/checkpoints/main/20")
        assert await resp.json() == rows[1]
        resp = await client.get("/admin/checkpoints/main/20", headers=AUTH)
        manifest = await resp.json()
        assert manifest["step"] == 20 and manifest["status"] == ["committed"]
        assert manifest["extra"]["trainguard"]["offsets"] == {"0": "1-4", "1": "1-2"}
        assert set(manifest["tensors"]) == {"w", "b"}
        resp = await client.get("/admin/checkpoints/main/20/verify")
        assert await resp.json() == {"step": 20, "valid": True, "reason": None}
        _corrupt_newest_chunk(root)
        resp = await client.get("/admin/checkpoints/main/20/verify")
        verdict = await resp.json()
        assert resp.status == 200 and verdict["valid"] is False and verdict["reason"]
        resp = await client.get("/admin/checkpoints/main/10/verify")
        assert (await resp.json())["valid"] is True


async def test_pin_unpin_and_delete_refusals(redis_server, tmp_path):
    """Pin shows in the status and blocks delete (409); the newest valid checkpoint
    cannot be deleted (409), and when the newest is damaged the one before it is the
    protected one; an older unpinned one is deleted."""
    root = tmp_path / "ck"
    save_checkpoints(str(root), [1, 2, 3, 4], {0: "1-1"})
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        resp = await client.post("/admin/checkpoints/main/2/pin", headers=AUTH)
        assert resp.status == 200 and "pinned" in (await resp.json())["status"]
        resp = await client.delete("/admin/checkpoints/main/2", headers=AUTH)
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "pinned"
        resp = await client.delete("/admin/checkpoints/main/4", headers=AUTH)
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "newest_checkpoint"
        resp = await client.post("/admin/checkpoints/main/2/unpin", headers=AUTH)
        assert resp.status == 200 and "pinned" not in (await resp.json())["status"]
        resp = await client.delete("/admin/checkpoints/main/2", headers=AUTH)
        assert resp.status == 200
        _corrupt_newest_chunk(root)  # step 4 is damaged: step 3 is what a restart uses
        resp = await client.delete("/admin/checkpoints/main/3", headers=AUTH)
        assert resp.status == 409
        resp = await client.delete("/admin/checkpoints/main/1", headers=AUTH)
        assert resp.status == 200
        steps = [r["step"] for r in (await (await client.get("/admin/checkpoints/main")).json())
                 ["checkpoints"]]
        assert steps == [3, 4]
    assert [m.step for m in CheckpointStore(str(root)).list()] == [3, 4]


async def test_checkpoint_mutations_need_token_and_bad_input_is_4xx(redis_server, tmp_path):
    """Pin/unpin/delete without token 401, wrong token 403; unknown store/step 404;
    a non-integer step 400; nothing changed by the refused calls."""
    root = tmp_path / "ck"
    save_checkpoints(str(root), [1, 2], {0: "1-1"})
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        for method, path in (("POST", "/admin/checkpoints/main/1/pin"),
                             ("POST", "/admin/checkpoints/main/1/unpin"),
                             ("DELETE", "/admin/checkpoints/main/1")):
            assert (await client.request(method, path)).status == 401
            resp = await client.request(method, path, headers={"Authorization": "Bearer x"})
            assert resp.status == 403
        for path, status, code in (("/admin/checkpoints/nope", 404, "store_not_found"),
                                   ("/admin/checkpoints/main/99", 404, "checkpoint_not_found"),
                                   ("/admin/checkpoints/main/x1", 400, "bad_step"),
                                   ("/admin/checkpoints/main/99/verify", 404,
                                    "checkpoint_not_found")):
            resp = await client.get(path)
            assert (resp.status, (await resp.json())["error"]["code"]) == (status, code), path
        resp = await client.delete("/admin/checkpoints/main/99", headers=AUTH)
        assert resp.status == 404
    assert [(m.step, m.pinned) for m in CheckpointStore(str(root)).list()] == [
        (1, False), (2, False)]


async def test_seek_to_a_checkpoints_offsets(redis_server, tmp_path):
    """Seek with {"checkpoint": {store, step}} moves the group to exactly the offsets
    in that manifest; a checkpoint of another dataset is refused (409)."""
    r = aioredis.Redis.from_url(redis_server.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2)
    root, other = tmp_path / "ck", tmp_path / "other"
    save_checkpoints(str(root), [5, 6], {0: "1-3", 1: "1-1"})
    save_checkpoints(str(other), [1], {0: "1-1"}, dataset="elsewhere")
    async with admin_client(redis_server.url, stores={"main": root, "other": other}) as client:
        url = "/admin/datasets/toy/groups/run1/seek"
        resp = await client.post(url, json={"checkpoint": {"store": "main", "step": 5}},
                                 headers=AUTH)
        assert resp.status == 200
        for p, want in ((0, b"1-3"), (1, b"1-1")):
            info = await r.xinfo_groups(streams.partition_key("toy", p))
            assert info[0]["last-delivered-id"] == want
        resp = await client.post(url, json={"checkpoint": {"store": "other", "step": 1}},
                                 headers=AUTH)
        assert resp.status == 409 and (await resp.json())["error"]["code"] == "wrong_dataset"
        resp = await client.post(url, json={"checkpoint": {"store": "main", "step": 7}},
                                 headers=AUTH)
        assert resp.status == 404
    await r.aclose()


async def test_readyz_checks_redis_and_every_store(redis_server, tmp_path):
    """/readyz of the whole service is 200 with every store answering, 503 naming
    the store when one cannot be read, and 503 when Redis is down."""
    from aiohttp.test_utils import TestClient, TestServer

    from ingest_service.service.admin import AdminConfig
    from ingest_service.service.admin_checkpoints import StoreRoot
    from tests.admin_helpers import service_app

    good = tmp_path / "good"
    save_checkpoints(str(good), [1], {0: "1-0"})
    broken = tmp_path / "a-file"
    broken.write_text("not a directory")
    for stores, want in (({"good": good}, 200), ({"good": good, "broken": broken}, 503)):
        roots = {n: StoreRoot(n, str(u)) for n, u in stores.items()}
        app = service_app(AdminConfig(redis_server.url, None, roots))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.get("/readyz")
            body = await resp.json()
            assert resp.status == want, body
            assert body["stores"]["good"] == "ok"
            if want == 503:
                assert body["ready"] is False and "broken" in body["reason"]
    app = service_app(AdminConfig(redis_server.url, None, {
        "good": StoreRoot("good", str(good))}))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        redis_server.kill()
        resp = await client.get("/readyz")
        assert resp.status == 503


async def test_status_local_only_and_remote_tier(redis_server, tmp_path, moto_server):
    """With a remote tier (real S3 on moto), a checkpoint whose manifest is also
    under the remote root is "remote", one only on local disk is "local_only"; pin
    and unpin reach the remote copy too (its retention honours only its own pins)."""
    import s3fs

    from ingest_service.service.admin_checkpoints import StoreRoot

    local = tmp_path / "ck"
    save_checkpoints(str(local), [1, 2], {0: "1-0"})
    fs = s3fs.S3FileSystem(**moto_server.storage_options())
    # A plain CreateBucket: the shared s3_bucket fixture's s3fs.mkdir sends a
    # LocationConstraint of us-east-1, which moto (like S3) refuses.
    s3_bucket = f"tg-admin-{os.getpid()}-{tmp_path.name}".lower().replace("_", "-")[:63]
    fs.call_s3("create_bucket", Bucket=s3_bucket)
    fs.put(str(local) + "/", f"{s3_bucket}/run/", recursive=True)  # what a tier sync does
    save_checkpoints(str(local), [3], {0: "1-0"})
    root = StoreRoot("main", str(local), f"s3://{s3_bucket}/run",
                     storage_options=moto_server.storage_options())
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        resp = await client.post("/admin/checkpoints/main/1/pin", headers=AUTH)
        assert resp.status == 200
        rows = (await (await client.get("/admin/checkpoints/main")).json())["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [
        (1, ["committed", "pinned", "remote"]),
        (2, ["committed", "remote"]),
        (3, ["committed", "local_only"]),
    ]
    remote = CheckpointStore(f"s3://{s3_bucket}/run",
                             storage_options=moto_server.storage_options())
    assert [(m.step, m.pinned) for m in remote.list()] == [(1, True), (2, False)]
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        resp = await client.post("/admin/checkpoints/main/1/unpin", headers=AUTH)
        assert (await resp.json())["status"] == ["committed", "remote"]
    assert [(m.step, m.pinned) for m in remote.list()] == [(1, False), (2, False)]
    remote.close()


async def test_a_step_saved_twice_means_its_newest_save(redis_server, tmp_path):
    """When a step was saved twice (e.g. after a rollback), show and seek use the
    newest save of that step, as the store's own verify, pin and load do."""
    r = aioredis.Redis.from_url(redis_server.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2)
    root = tmp_path / "ck"
    save_checkpoints(str(root), [5], {0: "1-1", 1: "1-1"})
    save_checkpoints(str(root), [5], {0: "1-3", 1: "1-2"})
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        manifest = await (await client.get("/admin/checkpoints/main/5", headers=AUTH)).json()
        assert manifest["extra"]["trainguard"]["offsets"] == {"0": "1-3", "1": "1-2"}
        resp = await client.post("/admin/datasets/toy/groups/run1/seek",
                                 json={"checkpoint": {"store": "main", "step": 5}},
                                 headers=AUTH)
        assert (await resp.json())["offsets"] == {"0": "1-3", "1": "1-2"}
    await r.aclose()


async def test_seek_to_a_checkpoint_of_per_rank_objects_reads_every_rank(redis_server,
                                                                          tmp_path):
    """A checkpoint of session record 3 keeps its offsets in the ranks' state objects,
    not the manifest: the seek to it reads every rank's object and moves each
    partition to the offset its owner committed."""
    from trainguard.core.rank_record import RankRecord
    from trainguard.core.record import SessionRecord

    r = aioredis.Redis.from_url(redis_server.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2)
    root = tmp_path / "ck"
    rec = SessionRecord(dataset="toy", run="run1", partitions=2, generation=1, commit=1,
                        world_size=1, num_workers=2, version=3)
    own = RankRecord(rank=0, world_size=1, num_workers=2, offsets={0: "1-3", 1: "1-1"})
    store = CheckpointStore(str(root), keep_last=100)
    store.save({"w": torch.zeros(3)}, step=7, extra=rec.to_extra(),
               rank_state=own.to_wire(), blocking=True)
    store.close()
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        resp = await client.post("/admin/datasets/toy/groups/run1/seek",
                                 json={"checkpoint": {"store": "main", "step": 7}},
                                 headers=AUTH)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["offsets"] == {"0": "1-3", "1": "1-1"}
    await r.aclose()


async def test_delete_protects_the_checkpoint_a_session_restores_from(redis_server, tmp_path):
    """A zombie trainer (older fencing generation) may commit after the newer one:
    then the newest in commit order (the zombie's step 30) and the one a
    TrainingSession restores (generation 2, step 15) are both refused; older go."""
    import torch

    root = tmp_path / "ck"
    store = CheckpointStore(str(root), keep_last=100)
    state = {"w": torch.zeros(3)}
    for step, gen, commit in ((10, 1, 1), (20, 1, 2), (15, 2, 3), (30, 1, 3)):
        tg = {"dataset": "toy", "run": "run1", "generation": gen, "commit": commit,
              "offsets": {"0": "1-0"}}
        store.save(state, step=step, extra={"trainguard": tg}, blocking=True)
    store.close()
    async with admin_client(redis_server.url, stores={"main": root}) as client:
        for step in (15, 30):
            resp = await client.delete(f"/admin/checkpoints/main/{step}", headers=AUTH)
            assert resp.status == 409, step
            assert (await resp.json())["error"]["code"] == "newest_checkpoint"
        for step in (10, 20):
            resp = await client.delete(f"/admin/checkpoints/main/{step}", headers=AUTH)
            assert resp.status == 200, step
    assert [m.step for m in CheckpointStore(str(root)).list()] == [15, 30]
