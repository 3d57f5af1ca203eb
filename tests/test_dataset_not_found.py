"""A dataset's spec, or its "not found", has one home (``DatasetSpec.of_meta``): the
ingest registry, the admin API's inspection and the trainer read it alike."""

from __future__ import annotations

import pytest

from ingest_service import redis_client as ingest_redis
from ingest_service.datasets import create_dataset, describe_dataset
from ingest_service.errors import NotFound
from ingest_service.inspection import dataset_spec
from tests.servers import RedisServer
from trainer_client import redis_client as trainer_redis
from trainer_client.dataset import load_spec
from trainguard.core import streams


async def test_every_side_reads_the_same_spec_and_the_same_not_found(
        redis_server: RedisServer) -> None:
    """The registry, the admin API and the trainer return the one stored spec, and for
    a dataset never created each refuses with the same message (the admin API as its
    404 ``dataset_not_found``), naming the dataset and what to do."""
    spec = streams.DatasetSpec(name="ds", partitions=3, source="memory://x.jsonl",
                               format="jsonl", seed=5)
    r = ingest_redis.client(redis_server.url)
    sync = trainer_redis.client(redis_server.url)
    try:
        await create_dataset(r, spec)
        assert await describe_dataset(r, "ds") == await dataset_spec(r, "ds") == spec
        assert load_spec(sync, "ds") == spec
        with pytest.raises(streams.DatasetNotFoundError) as registry:
            await describe_dataset(r, "nope")
        with pytest.raises(streams.DatasetNotFoundError) as trainer:
            load_spec(sync, "nope")
        with pytest.raises(NotFound) as admin:
            await dataset_spec(r, "nope")
    finally:
        await r.aclose()
        sync.close()
    message = str(registry.value)
    assert "'nope' does not exist" in message and "trainguard datasets create" in message
    assert str(trainer.value) == message == str(admin.value)
    assert admin.value.code == "dataset_not_found"
