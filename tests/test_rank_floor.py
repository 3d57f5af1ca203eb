"""The retention floor on the per-rank path: rank 0 lists the store once per commit
and publishes the kept checkpoints; every other rank reads that one key instead of
listing the store. The floor of rank 0's partitions is the one a full listing gives;
another rank's is that, or (when it read the key before rank 0 published this
commit's) also held down by the checkpoint this commit's retention deleted: never
above what a kept checkpoint needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests.test_rank_skips import rank_lines
from trainguard.core import record, streams
from trainguard.core.rank_record import checkpoint_positions

N, P = 160, 4


def test_only_rank_0_lists_the_store_and_the_floor_is_the_listings(
        redis_server, tmp_path: Path) -> None:
    """Two ranks, a first attempt of one commit, then three commits (keep_last 3: the
    last drops the first attempt's): rank 1 lists the store 0 times (before, once per
    commit), rank 0 three; the floor of rank 0's partitions equals retention_floor
    over the kept checkpoints (read whole), rank 1's equals it or its minimum with the
    dropped checkpoint's offset; the kept key names exactly the kept checkpoints."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    url = f"file://{tmp_path}/c"
    rank_lines(redis_server.url, url, 2, 2)  # a first attempt: checkpoints to keep
    store = CheckpointStore(url)
    (first,) = store.list()
    dropped = checkpoint_positions(store, first).offsets
    store.close()
    out = rank_lines(redis_server.url, url, 2, 2, "--commits", "3")
    assert [int(x["LISTS"]) for x in out] == [3, 0]

    kept, offsets, expected = _floor_of(url)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    floor = client.hgetall(streams.floor_key("tok", "exp"))
    published = client.get(streams.kept_key("tok", "exp"))
    client.close()
    assert first.name not in {m.name for m in kept}
    assert expected != offsets  # the older kept checkpoints hold the floor down
    mine0 = streams.rank_partitions(P, world_size=2, num_workers=0, rank=0)
    for p in range(P):
        allowed = {expected[p]} if p in mine0 else {
            expected[p], streams.min_id(expected[p], dropped[p])}
        assert floor[str(p)] in allowed, (p, floor, expected, dropped)
    assert published is not None
    assert [k["name"] for k in json.loads(published)["kept"]] == [m.name for m in kept]


def test_a_rank_owning_no_partition_publishes_nothing_and_warns_nothing(
        redis_server, tmp_path: Path) -> None:
    """Three ranks over two partitions: rank 2 owns none. Over two commits no rank
    logs a warning (before, rank 2's publish sent an HSET without fields, refused by
    redis-py, and logged "acknowledging offsets after commit failed" at each commit);
    the committed offsets are exactly the newest checkpoint's of partitions 0 and 1,
    the floor is retention_floor over the kept checkpoints, and the kept key names
    them."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, N)
    url = f"file://{tmp_path}/c"
    out = rank_lines(redis_server.url, url, 3, 2, "--commits", "2")
    assert [int(x["WARNED"]) for x in out] == [0, 0, 0]
    # A fresh run: a rank reading the kept key before rank 0's first publish lists.
    lists = [int(x["LISTS"]) for x in out]
    assert lists[0] == 2 and max(lists[1:]) <= 1, lists

    kept, offsets, expected = _floor_of(url)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    committed = client.hgetall(streams.committed_key("tok", "exp"))
    floor = client.hgetall(streams.floor_key("tok", "exp"))
    published = client.get(streams.kept_key("tok", "exp"))
    client.close()
    assert set(offsets) == {0, 1}
    assert committed == {str(p): i for p, i in offsets.items()}
    assert floor == {str(p): i for p, i in expected.items()}
    assert published is not None
    assert [k["name"] for k in json.loads(published)["kept"]] == [m.name for m in kept]


def _floor_of(url: str) -> tuple[list[Any], dict[int, str], dict[int, str]]:
    """The kept checkpoints, the newest one's offsets, and the retention floor they
    give (what rank 0 must publish), read from the store itself."""
    store = CheckpointStore(url)
    try:
        kept = store.list()
        offsets = checkpoint_positions(store, kept[-1]).offsets
        expected = record.retention_floor(
            offsets, kept, dataset="tok", run="exp",
            positions=lambda m, rec: checkpoint_positions(store, m).offsets)
    finally:
        store.close()
    return kept, offsets, expected
