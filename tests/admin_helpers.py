"""Helpers of the admin API and CLI tests: a populated dataset, checkpoints with
offsets in their manifests, and an admin app served on a real loopback port."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import redis.asyncio as aioredis
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ingest_service.datasets import create_dataset
from ingest_service.service.admin import AdminConfig, setup_admin
from ingest_service.service.admin_checkpoints import StoreRoot
from tests.servers import free_port
from trainguard.core import streams

TOKEN = "s3cret-token-for-the-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def make_dataset(
    r: aioredis.Redis, name: str = "toy", *, partitions: int = 2, per_partition: int = 5
) -> streams.DatasetSpec:
    """A registered dataset whose partition p holds IDs 1-0 .. 1-(n-1), as the
    producer writes them (XADD with deterministic IDs), plus one dead letter."""
    spec = streams.DatasetSpec(name=name, partitions=partitions, source="memory://x.jsonl")
    await create_dataset(r, spec)
    for p in range(partitions):
        for i in range(per_partition):
            await r.xadd(
                streams.partition_key(name, p),
                streams.encode_record({"p": p, "i": i}, pos=f"x.jsonl:{i}"),
                id=streams.make_id(0, i),
            )
    await r.xadd(
        streams.dlq_key(name), streams.encode_dead_letter("undecodable", "x.jsonl:99", b"{")
    )
    return spec


async def make_group(
    r: aioredis.Redis, dataset: str, group: str, partitions: int,
    *, floor: Mapping[int, str] | None = None,
) -> None:
    """A consumer group registered the way a trainer registers its run."""
    for p in range(partitions):
        await r.xgroup_create(streams.partition_key(dataset, p), group, id="0-0", mkstream=True)
    await r.sadd(streams.groups_key(dataset), group)
    if floor:
        await r.hset(streams.floor_key(dataset, group), mapping=streams.offsets_to_wire(floor))


def save_checkpoints(url: str, steps: list[int], offsets: Mapping[int, str],
                     dataset: str = "toy") -> None:
    """Real checkpoints through checkpoint_store, offsets in the manifest's extra."""
    from checkpoint_store import CheckpointStore

    store = CheckpointStore(url, keep_last=100)
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
             "b": torch.ones(3, dtype=torch.bfloat16)}
    for step in steps:
        # The shape TrainingSession.checkpoint writes into the manifest.
        tg = {"dataset": dataset, "run": "run1", "offsets": streams.offsets_to_wire(offsets)}
        store.save(state, step=step, extra={"trainguard": tg}, blocking=True)


@asynccontextmanager
async def admin_client(
    redis_url: str, *, token: str | None = TOKEN,
    stores: Mapping[str, Path | str | StoreRoot] | None = None,
) -> AsyncIterator[TestClient]:
    app = web.Application()
    roots = {
        name: url if isinstance(url, StoreRoot) else StoreRoot(name, str(url))
        for name, url in (stores or {}).items()
    }
    setup_admin(app, AdminConfig(redis_url, token, roots))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


class ThreadedServer:
    """An aiohttp app served by a real socket from a background thread's event loop,
    for clients that are not asyncio (schemathesis, the CLI in-process)."""

    def __init__(self, app: web.Application):
        self.app = app
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadedServer:
        self.thread.start()

        async def up() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def service_app(config: AdminConfig, push_tokens: str = "") -> web.Application:
    """The whole service (``create_app``, producers off), whose admin part reads its
    token and stores, and whose push route its producer tokens, from the environment
    as in production: set from ``config`` and ``push_tokens``."""
    from ingest_service.service.app import create_app
    from ingest_service.service.config import IngestConfig

    stores = ",".join(f"{name}={root.url}" for name, root in config.stores.items())
    env = {"TRAINGUARD_ADMIN_TOKEN": config.token or "", "TRAINGUARD_CHECKPOINT_STORES": stores,
           "TRAINGUARD_PUSH_TOKENS": push_tokens,
           "TRAINGUARD_READ_TOKEN": getattr(config, "read_token", None) or ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return create_app(IngestConfig.from_env(redis_url=config.redis_url, produce=False))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
