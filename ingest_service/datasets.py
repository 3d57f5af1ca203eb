"""Dataset registry in Redis: create, describe, delete, list.

A dataset is its :class:`~trainguard.core.streams.DatasetSpec`, stored as a hash under
``meta_key(name)``, and its name in the ``datasets_key()`` set. Creating is idempotent
for identical settings and refused for different ones, so two services racing to
create the same dataset agree or one of them fails loudly.
"""

from __future__ import annotations

from collections.abc import Mapping

from redis.asyncio import Redis

from ingest_service.errors import DatasetExistsError
from trainguard.core import streams

__all__ = [
    "create_dataset", "describe_dataset", "delete_dataset", "list_datasets", "spec_from_hash",
]

# HSETNX-like for a whole hash: write the spec only when the meta key is absent, so that
# of two concurrent creators exactly one writes and the other compares.
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
for i = 1, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
"""


async def create_dataset(redis: Redis, spec: streams.DatasetSpec) -> streams.DatasetSpec:
    """Register ``spec``; returns the stored spec.

    Raises DatasetExistsError (listing the differing fields) when a dataset of that
    name exists with other settings.
    """
    flat: list[str] = []
    for k, v in spec.to_redis().items():
        flat += [k, v]
    created = await redis.eval(_CREATE_LUA, 1, streams.meta_key(spec.name), *flat)
    # The name set lives in another hash slot: added after the meta key, and again on
    # every create, so a crash between the two is repaired by the next create.
    await redis.sadd(streams.datasets_key(), spec.name)
    if created:
        return spec
    existing = await describe_dataset(redis, spec.name)
    diff = existing.differences(spec)
    if diff:
        raise DatasetExistsError(spec.name, diff)
    return existing


async def describe_dataset(redis: Redis, name: str) -> streams.DatasetSpec:
    streams.check_name("dataset", name)
    return spec_from_hash(name, await redis.hgetall(streams.meta_key(name)))


def spec_from_hash(name: str, raw: Mapping[bytes | str, bytes | str]) -> streams.DatasetSpec:
    """The spec stored as ``raw`` (the meta hash of dataset ``name``); raises
    DatasetNotFoundError when the hash is empty."""
    return streams.DatasetSpec.of_meta(name, raw)


async def delete_dataset(redis: Redis, name: str) -> None:
    """Remove the dataset's metadata, partitions and bookkeeping keys.

    Raises DatasetNotFoundError when it does not exist. A producer still running for
    it notices the missing meta key and stops treating the dataset as its own.
    """
    spec = await describe_dataset(redis, name)
    keys = [
        streams.meta_key(name),
        streams.dlq_key(name),
        streams.paused_key(name),
        streams.progress_key(name),
        streams.producers_key(name),
    ]
    groups = await redis.smembers(streams.groups_key(name))
    for g in groups:
        group = g.decode() if isinstance(g, bytes) else str(g)
        keys += [streams.committed_key(name, group), streams.floor_key(name, group),
                 streams.generation_key(name, group), streams.kept_key(name, group)]
    keys.append(streams.groups_key(name))
    # Keys of different hash slots: delete one by one (Cluster-safe), pipelined.
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.delete(key)
        for p in range(spec.partitions):
            pipe.delete(streams.partition_key(name, p), streams.seq_key(name, p),
                        streams.lease_key(name, p))
            for g in groups:
                group = g.decode() if isinstance(g, bytes) else str(g)
                pipe.delete(streams.fence_key(name, p, group))
        pipe.srem(streams.datasets_key(), name)
        await pipe.execute()


async def list_datasets(redis: Redis) -> list[str]:
    names = await redis.smembers(streams.datasets_key())
    return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)
