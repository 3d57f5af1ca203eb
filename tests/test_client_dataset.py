"""StreamingDataset against a real redis-server: partitions, decoding, end of data,
blocking reads, Redis restarts and fencing of reads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import torch
from torch.utils.data import DataLoader

from tests import _client_fill as cf
from trainer_client import offsets as ofs
from trainer_client import redis_client
from trainer_client.dataset import Batch, StreamingDataset
from trainer_client.errors import DatasetNotFoundError, EvictionRefusedError, FencedError
from trainguard.core import streams

ROOT = Path(__file__).resolve().parents[1]


def _ids(batches: list[Batch]) -> list[int]:
    return [int(i) for b in batches for i in b.data[:, 0].tolist()]


def test_one_process_reads_every_record_once_with_offsets(redis_target) -> None:
    """num_workers=0: every record exactly once, full batches but the last, and each
    batch's offsets are the last ID of each partition in it."""
    spec = cf.create(redis_target.url, "tok", partitions=4)
    cf.fill(redis_target.url, spec, 1001)
    ds = StreamingDataset(redis_target.url, "tok", "run", batch_size=32)
    batches = list(DataLoader(ds, batch_size=None, num_workers=0))
    assert sorted(_ids(batches)) == list(range(1001))
    assert [len(b) for b in batches[:-1]] == [32] * (len(batches) - 1)
    for b in batches:
        assert b.offsets == {p: ids[-1] for p, ids in b.ids.items()}
        for p, ids in b.ids.items():
            parsed = [streams.parse_id(i) for i in ids]
            assert parsed == sorted(parsed)
            # the record payload says which record it is: it must sit in its partition
            assert all(streams.make_id(0, r // 4) in ids for r in b.data[:, 0].tolist() if r % 4 == p)
    client = redis_client.client(redis_target.url)
    assert client.sismember(streams.groups_key("tok"), "run")


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_read_their_assigned_partitions(any_redis, persistent: bool) -> None:
    """num_workers=2 over 7 partitions: worker w reads exactly the partitions that
    assign_partitions gives it, and together they read every record once."""
    spec = cf.create(any_redis.url, "tok", partitions=7)
    cf.fill(any_redis.url, spec, 700)
    ds = StreamingDataset(any_redis.url, "tok", "run", batch_size=10)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    batches = list(loader)
    assert sorted(_ids(batches)) == list(range(700))
    for b in batches:
        expect = streams.assign_partitions(7, world_size=1, num_workers=2, rank=0, worker=b.worker)
        assert set(b.ids) <= set(expect)
    assert {p for b in batches for p in b.ids} == set(range(7))


def test_ranks_split_partitions(any_redis) -> None:
    """Two ranks (no workers) read disjoint partition sets covering every record."""
    spec = cf.create(any_redis.url, "tok", partitions=5)
    cf.fill(any_redis.url, spec, 500)
    got = []
    for rank in range(2):
        ds = StreamingDataset(any_redis.url, "tok", "run", batch_size=16, rank=rank, world_size=2)
        got.append(_ids(list(ds)))
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == list(range(500))
    assert {i % 5 for i in got[0]} == {0, 2, 4}


def test_decoding_kinds(redis_target) -> None:
    """Token arrays become one [n, len] tensor of their dtype; raw bytes and msgpack
    come back as values; a decode callable maps each record."""
    spec = cf.create(redis_target.url, "mixed", partitions=1)
    client = redis_client.client(redis_target.url)
    key = streams.partition_key("mixed", 0)
    for i in range(4):
        client.xadd(key, streams.encode_record(np.arange(6, dtype=np.int32) + i), id=streams.make_id(0, i))
    ds = StreamingDataset(redis_target.url, "mixed", "g", batch_size=4)
    cf.mark_finished(client, spec, 4)
    (b,) = list(ds)
    assert isinstance(b.data, torch.Tensor) and b.data.dtype == torch.int32
    assert b.data.shape == (4, 6) and b.data[3].tolist() == [3, 4, 5, 6, 7, 8]
    assert b.data.is_contiguous()

    spec2 = cf.create(redis_target.url, "objs", partitions=1)
    key2 = streams.partition_key("objs", 0)
    client.xadd(key2, streams.encode_record(b"\x00raw"), id="1-0")
    client.xadd(key2, streams.encode_record({"a": [1, 2]}), id="1-1")
    cf.mark_finished(client, spec2, 2)
    (b2,) = list(StreamingDataset(redis_target.url, "objs", "g", batch_size=8))
    assert b2.data == [b"\x00raw", {"a": [1, 2]}]
    (b3,) = list(StreamingDataset(redis_target.url, "objs", "g2", batch_size=8, decode=repr))
    assert b3.data == [repr(b"\x00raw"), repr({"a": [1, 2]})]
    assert msgpack  # the contract's msgpack is what decodes the second record


def test_missing_dataset_is_a_clear_error(redis_target) -> None:
    """A dataset without metadata raises DatasetNotFoundError (a LookupError) naming it."""
    with pytest.raises(DatasetNotFoundError, match="'nope' does not exist") as info:
        StreamingDataset(redis_target.url, "nope", "run", batch_size=4)
    assert isinstance(info.value, LookupError)


def test_endless_dataset_blocks_until_records_arrive(redis_target) -> None:
    """An endless dataset does not end when it runs dry: it blocks and yields records
    appended later, each once."""
    spec = cf.create(redis_target.url, "live", partitions=2, epochs=None)
    cf.fill(redis_target.url, spec, 20, finish=False)
    ds = StreamingDataset(redis_target.url, "live", "run", batch_size=10, block_ms=100)
    it = iter(ds)
    first = [next(it), next(it)]
    assert sorted(_ids(first)) == list(range(20))
    got: list[Batch] = []
    t = threading.Thread(target=lambda: got.extend([next(it), next(it)]))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not got  # blocked: nothing to read
    cf.fill(redis_target.url, spec, 40, start=20, finish=False)
    t.join(60)
    assert sorted(_ids(got)) == list(range(20, 40))
    it.close()


def test_redis_restart_loses_nothing_and_repeats_nothing(redis_factory) -> None:
    """Redis is SIGKILLed mid-read and comes back empty (no persistence); the producer
    replays the same deterministic IDs from the start. The reader reconnects with
    backoff, moves the group to where it was, and yields every record exactly once."""
    server = redis_factory()
    spec = cf.create(server.url, "tok", partitions=3)
    cf.fill(server.url, spec, 300, finish=False)
    ds = StreamingDataset(server.url, "tok", "run", batch_size=25, block_ms=200)
    it = iter(ds)
    before = [next(it) for _ in range(5)]
    server.restart()
    cf.create(server.url, "tok", partitions=3)
    cf.fill(server.url, spec, 600)  # replay from record 0, then the rest
    after = list(it)
    counts = Counter(_ids(before + after))
    assert sorted(counts) == list(range(600))
    assert set(counts.values()) == {1}


def test_aof_rewind_drops_records_delivered_twice(redis_factory) -> None:
    """With AOF, the group's position survives a restart; even when we force it back
    (as a lost AOF tail does), records this reader already yielded are not yielded
    again."""
    server = redis_factory(persistence="always")
    spec = cf.create(server.url, "tok", partitions=2)
    cf.fill(server.url, spec, 200)
    ds = StreamingDataset(server.url, "tok", "run", batch_size=20)
    it = iter(ds)
    before = [next(it) for _ in range(4)]
    server.restart()
    client = redis_client.client(server.url)
    for p in range(2):  # rewind the group, as if the AOF lost its last second
        client.xgroup_setid(streams.partition_key("tok", p), "run", "0-0")
    after = list(it)
    counts = Counter(_ids(before + after))
    assert sorted(counts) == list(range(200)) and set(counts.values()) == {1}


def test_reader_of_an_older_generation_is_fenced(any_redis) -> None:
    """Once a newer trainer took generation 2, a reader holding generation 1 cannot
    read (its read would move the newer trainer's group)."""
    spec = cf.create(any_redis.url, "tok", partitions=2)
    cf.fill(any_redis.url, spec, 50)
    client = redis_client.client(any_redis.url)
    assert ofs.bump_generation(client, "tok", "run", 2, floor=1) == 2
    ds = StreamingDataset(any_redis.url, "tok", "run", batch_size=8, generation=1)
    with pytest.raises(FencedError, match="generation 2 has restored") as info:
        next(iter(ds))
    assert info.value.mine == 1 and info.value.current == 2
    for p in range(2):  # nothing was delivered to the zombie: no group was even made
        assert client.xinfo_groups(streams.partition_key("tok", p)) == []


def _readers(url: str) -> list[str]:
    """The names of the reading connections open on every server of ``url``."""
    client = redis_client.client(url)
    names = [c["name"] for n in redis_client.servers(client) for c in n.client_list(_type="normal")
             if c["name"].startswith("trainguard-reader|")]
    client.close()
    return sorted(names)


def _group_positions(client, partitions: int) -> list[bytes]:
    return [client.xinfo_groups(streams.partition_key("tok", p))[0]["last-delivered-id"]
            for p in range(partitions)]


def test_a_newer_generation_closes_the_open_connections_of_older_readers(any_redis) -> None:
    """A reader of generation 1 reading with open connections (their fences checked when
    they opened) when generation 2 takes over: the bump closes those connections, so
    nothing the old reader sends afterwards runs, and the reader's next read is refused
    with FencedError without moving the group."""
    spec = cf.create(any_redis.url, "tok", partitions=4)
    cf.fill(any_redis.url, spec, 400)
    client = redis_client.client(any_redis.url)
    assert ofs.bump_generation(client, "tok", "run", 4, floor=0) == 1
    ds = StreamingDataset(any_redis.url, "tok", "run", batch_size=8, generation=1)
    it = iter(ds)
    next(it)
    names = _readers(any_redis.url)
    assert names and set(names) == {"trainguard-reader|tok|run|1"}
    reader = it.gi_frame.f_locals["reader"]  # the pass's Reader, to reach its connections
    conns = list(reader.node_conns.values())

    assert ofs.bump_generation(client, "tok", "run", 4, floor=1) == 2
    assert _readers(any_redis.url) == []
    before = _group_positions(client, 4)
    for conn in conns:  # a command the old reader sends now never runs
        with pytest.raises(redis.exceptions.ConnectionError):
            conn.send_command("XREADGROUP", "GROUP", "run", "r0w0", "COUNT", 10,
                              "STREAMS", streams.partition_key("tok", 0), ">")
            for _ in range(4 + 1):  # a read sent ahead before the bump answers first
                conn.read_response()
    with pytest.raises(FencedError, match=r"read refused.*generation 2 has restored"):
        for _ in range(100):
            next(it)
    assert _group_positions(client, 4) == before
    client.close()


def test_readers_of_the_current_generation_and_other_runs_stay_connected(redis_server) -> None:
    """Eviction closes only older generations of the same run: the newest reader and
    the readers of another run (another group) keep reading."""
    spec = cf.create(redis_server.url, "tok", partitions=2)
    cf.fill(redis_server.url, spec, 100)
    client = redis_client.client(redis_server.url)
    gen = ofs.bump_generation(client, "tok", "run", 2, floor=0)
    ours = iter(StreamingDataset(redis_server.url, "tok", "run", batch_size=5, generation=gen))
    other = iter(StreamingDataset(redis_server.url, "tok", "run2", batch_size=5))
    got = [next(ours), next(other)]
    assert ofs.evict_readers(client, "tok", "run", gen) == 0
    assert ofs.evict_readers(client, "tok", "run", gen + 1) == 1  # ours, not run2's
    assert _readers(redis_server.url) == ["trainguard-reader|tok|run2|0"]
    got += list(other)
    assert sorted(_ids(got[1:])) == list(range(100))
    client.close()


def test_a_restore_without_client_kill_rights_says_which_grant_is_missing(redis_server) -> None:
    """Fencing readers needs CLIENT LIST and CLIENT KILL: a Redis user without them gets
    an error naming the grant, and the fences it could write are in place."""
    cf.create(redis_server.url, "tok", partitions=2)
    admin = redis_client.client(redis_server.url)
    admin.acl_setuser("trainer", enabled=True, passwords=["+trainer-password"], keys=["*"],
                      commands=["+@all", "-client|kill"])
    url = redis_server.url.replace("redis://", "redis://trainer:trainer-password@")
    client = redis_client.client(url)
    with pytest.raises(EvictionRefusedError, match=r"\+client\|kill") as info:
        ofs.bump_generation(client, "tok", "run", 2, floor=0)
    assert isinstance(info.value, PermissionError)
    assert [admin.get(streams.fence_key("tok", p, "run")) for p in range(2)] == [b"1", b"1"]
    client.close()
    admin.close()


def test_trainer_client_does_not_import_aiohttp() -> None:
    """What a training script imports (trainer_client, its session and dataset, and
    the checkpoint store the session opens) never loads aiohttp."""
    code = (
        "import sys, trainer_client, trainer_client.session, trainer_client.dataset, "
        "trainer_client.offsets, trainguard.core.record, checkpoint_store; "
        "from trainer_client import TrainingSession, StreamingDataset, Batch; "
        "print('aiohttp' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_more_workers_than_partitions(redis_target) -> None:
    """One partition, two workers: the worker that owns nothing ends at once, the
    other reads every record once."""
    spec = cf.create(redis_target.url, "tok", partitions=1)
    cf.fill(redis_target.url, spec, 50)
    ds = StreamingDataset(redis_target.url, "tok", "run", batch_size=8)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(_ids(batches)) == list(range(50))
    assert {b.worker for b in batches} == {0}


def test_dataset_made_during_a_redis_outage_waits_for_redis(redis_factory) -> None:
    """StreamingDataset() reads the dataset's metadata itself (no session): with Redis
    down (AOF, restarted 0.5 s later), the constructor waits and retries instead of
    raising, and the dataset then reads every record."""
    server = redis_factory(persistence="always")
    spec = cf.create(server.url, "tok", partitions=2)
    cf.fill(server.url, spec, 40)
    server.stop()
    restarter = threading.Timer(0.5, server.start)
    restarter.start()
    ds = StreamingDataset(server.url, "tok", "run", batch_size=10)
    restarter.join()
    assert sorted(_ids(list(ds))) == list(range(40))


@pytest.mark.parametrize(
    ("make", "check"),
    [
        # zero-size arrays: one batch tensor of shape (n, 0), nothing to read in it
        (lambda i: np.zeros(0, dtype=np.int64),
         lambda b: isinstance(b.data, torch.Tensor) and tuple(b.data.shape) == (len(b), 0)),
        # big-endian arrays: no native tensor exists for them, so the records come as a list
        (lambda i: np.full(4, i, dtype=">i4"),
         lambda b: isinstance(b.data, list) and all(r.dtype == np.dtype(">i4") for r in b.data)),
    ],
    ids=["zero-size", "big-endian"],
)
def test_unusual_arrays_are_batched_not_crashed(redis_target, make, check) -> None:
    """Record arrays that cannot be viewed as one native tensor by the fast path
    (zero-size, non-native byte order) still come back, every record once."""
    spec = cf.create(redis_target.url, "odd", partitions=2)
    cf.fill(redis_target.url, spec, 40, make=make)
    batches = list(StreamingDataset(redis_target.url, "odd", "run", batch_size=8))
    assert sum(len(b) for b in batches) == 40
    assert all(check(b) for b in batches)
    assert sorted(i for b in batches for ids in b.ids.values() for i in ids) == sorted(
        streams.make_id(0, i // 2) for i in range(40)
    )
