"""TrainingSession with a real redis-server and a real checkpoint store: offsets go into
manifests, acknowledgements follow commits, restores re-read exactly the uncommitted
records, prefetched batches do not count, zombies are fenced, errors are clear."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests.servers import RedisServer
from trainer_client import (
    Batch,
    CheckpointMismatchError,
    DatasetNotFoundError,
    FencedError,
    PartitionCountError,
    TrainingSession,
    redis_client,
)
from trainer_client import offsets as ofs
from trainguard.core import streams
from trainguard.core.rank_record import checkpoint_offsets
from trainguard.core.timing import TIMING_KEY


def _state() -> dict[str, object]:
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _session(url: str, tmp: Path, **kw: object) -> TrainingSession:
    kw.setdefault("dataset", "tok")
    kw.setdefault("run", "exp")
    kw.setdefault("block_ms", 100)
    return TrainingSession(url, store=f"file://{tmp}/ckpt", **kw)  # type: ignore[arg-type]


def _recs(batches: list[Batch]) -> list[int]:
    return [int(i) for b in batches for i in b.data[:, 0].tolist()]


def _take(it, n: int) -> list[Batch]:  # type: ignore[no-untyped-def]
    return [next(it) for _ in range(n)]


def test_fresh_run_reads_everything_and_final_checkpoint_acks_all(any_redis, tmp_path) -> None:
    """No checkpoint: restore returns 0 and reads every partition from its start; the
    final checkpoint's manifest holds the last IDs, and after it nothing is pending,
    the committed offsets and the floor are published."""
    spec = cf.create(any_redis.url, "tok", partitions=3)
    cf.fill(any_redis.url, spec, 90)
    s = _session(any_redis.url, tmp_path)
    state = _state()
    assert s.restore(state) == 0
    got = list(s.batches(DataLoader(s.dataset(batch_size=7), batch_size=None)))
    assert sorted(_recs(got)) == list(range(90))
    m = s.checkpoint(state, 13, blocking=True).wait()
    s.close()
    ends = {p: streams.make_id(0, 29) for p in range(3)}
    # The session record, exactly (the timing record beside it: test_run_history.py):
    # version 4 keeps the offsets, batches, random states and skips out of the manifest.
    assert {k: v for k, v in m.extra.items() if k != TIMING_KEY} == {"trainguard": {
        "version": 4, "dataset": "tok", "run": "exp", "partitions": 3, "generation": 1,
        "commit": 1, "world_size": 1, "num_workers": 0, "seed": zlib.crc32(b"exp"),
    }}
    # ... they are in the rank's own state object, indexed by digest in the manifest.
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    own = store.read_rank_state(m, 0)
    store.close()
    assert own is not None
    rng = own.pop("rng")
    assert sorted(rng) == ["numpy", "python", "torch"]  # no CUDA in use here
    assert own == {
        "version": 2, "rank": 0, "world_size": 1, "num_workers": 0,
        "offsets": {"0": "1-29", "1": "1-29", "2": "1-29"},
        # deterministic: 90 records in 13 batches of 7 (only the last one short: a
        # batch goes on in the next partition where one ends), each led by one
        "batches": {"0": 5, "1": 4, "2": 4},
        "epoch": 0, "epoch_batches": 13,
    }
    assert streams.offsets_from_wire(own["offsets"]) == ends
    client = redis_client.client(any_redis.url)
    assert streams.offsets_from_wire(client.hgetall(streams.committed_key("tok", "exp"))) == ends
    assert streams.offsets_from_wire(client.hgetall(streams.floor_key("tok", "exp"))) == ends
    for p in range(3):
        assert client.xpending(streams.partition_key("tok", p), "exp")["pending"] == 0


def test_restart_rereads_exactly_the_uncommitted_records(any_redis, tmp_path) -> None:
    """A trainer consumes 5 batches, checkpoints, consumes 3 more and dies. The next one
    restores the checkpoint's step and reads exactly the records after its offsets:
    checkpointed + re-read = every record once. Entries at or below the offsets are
    acknowledged, the ones after them pending until re-delivered."""
    spec = cf.create(any_redis.url, "tok", partitions=4)
    cf.fill(any_redis.url, spec, 200)
    a = _session(any_redis.url, tmp_path)
    state = _state()
    a.restore(state)
    it = iter(a.batches(DataLoader(a.dataset(batch_size=8), batch_size=None)))
    first = _take(it, 5)
    a.checkpoint(state, 5, blocking=True)
    assert a.offsets == {**{p: "0-0" for p in range(4)}, **{p: i for b in first for p, i in b.offsets.items()}}
    _take(it, 3)  # consumed but never checkpointed: lost with the crash
    client = redis_client.client(any_redis.url)
    committed = streams.offsets_from_wire(client.hgetall(streams.committed_key("tok", "exp")))
    for p in range(4):
        pending = client.xpending_range(streams.partition_key("tok", p), "exp", "-", "+", 1000)
        assert all(streams.parse_id(e["message_id"]) > streams.parse_id(committed[p]) for e in pending)

    b = _session(any_redis.url, tmp_path)
    assert b.restore(_state()) == 5
    rest = list(b.batches(DataLoader(b.dataset(batch_size=8), batch_size=None)))
    seen = _recs(first) + _recs(rest)
    assert sorted(seen) == list(range(200))
    b.checkpoint(_state(), 99, blocking=True)
    b.close()


def test_prefetched_batches_are_not_committed(redis_target, tmp_path) -> None:
    """With 2 workers prefetching 4 batches each, a checkpoint after 3 consumed batches
    holds exactly those 3 batches' offsets; a restart then reads every other record,
    including the ones that sat prefetched in the DataLoader's queues."""
    spec = cf.create(redis_target.url, "tok", partitions=4)
    cf.fill(redis_target.url, spec, 400)
    a = _session(redis_target.url, tmp_path)
    state = _state()
    a.restore(state)
    loader = DataLoader(a.dataset(batch_size=5), batch_size=None, num_workers=2, prefetch_factor=4)
    it = iter(a.batches(loader))
    first = _take(it, 3)
    import time

    time.sleep(0.5)  # let the workers fill their prefetch queues
    m = a.checkpoint(state, 3, blocking=True).wait()
    expect = {p: "0-0" for p in range(4)}
    for b in first:
        expect.update(b.offsets)
    assert checkpoint_offsets(a.store, m) == expect
    client = redis_client.client(redis_target.url)
    delivered = sum(client.xpending(streams.partition_key("tok", p), "exp")["pending"] for p in range(4))
    assert delivered > 0  # the workers really read ahead (still pending, not acked)
    it.close()

    b = _session(redis_target.url, tmp_path)
    b.restore(_state())
    rest = list(b.batches(DataLoader(b.dataset(batch_size=5), batch_size=None, num_workers=2)))
    assert sorted(_recs(first) + _recs(rest)) == list(range(400))
    b.close()
    a.close()


def test_zombie_cannot_read_ack_or_commit(any_redis, tmp_path) -> None:
    """Trainer A restores; trainer B of the same run restores after it. A's reads,
    acknowledgements and checkpoints are refused with FencedError, and nothing of A's
    reaches the store or Redis. A's checkpoint call returns before its fence is
    checked (the check runs in the save's background writer, before the commit): its
    handle fails with FencedError, and so does A's next call."""
    spec = cf.create(any_redis.url, "tok", partitions=2)
    cf.fill(any_redis.url, spec, 100)
    a = _session(any_redis.url, tmp_path)
    state = _state()
    a.restore(state)
    it = iter(a.batches(DataLoader(a.dataset(batch_size=10), batch_size=None)))
    consumed = _take(it, 2)
    b = _session(any_redis.url, tmp_path)
    b.restore(_state())
    assert b.generation == (a.generation or 0) + 1
    manifests_before = len(b.store.list())

    handle = a.checkpoint(state, 2)
    with pytest.raises(FencedError, match="checkpoint refused") as info:
        handle.wait()
    assert (info.value.mine, info.value.current) == (a.generation, b.generation)
    assert len(b.store.list()) == manifests_before
    with pytest.raises(FencedError, match="checkpoint refused"):
        a.checkpoint(state, 3)
    assert len(b.store.list()) == manifests_before
    client = redis_client.client(any_redis.url)
    offsets = {p: i for bt in consumed for p, i in bt.offsets.items()}
    pending_before = [client.xpending(streams.partition_key("tok", p), "exp")["pending"] for p in range(2)]
    with pytest.raises(FencedError, match="acknowledge refused"):
        ofs.ack_upto(client, "tok", "exp", a.generation or 0, offsets)
    pending_after = [client.xpending(streams.partition_key("tok", p), "exp")["pending"] for p in range(2)]
    assert pending_after == pending_before
    # A's reader is fenced as soon as it needs more data
    with pytest.raises(FencedError, match="read refused"):
        for _ in range(20):
            next(it)
    # B still reads everything after the (absent) checkpoint: all 100 records
    got = list(b.batches(DataLoader(b.dataset(batch_size=10), batch_size=None)))
    assert sorted(_recs(got)) == list(range(100))
    b.close()


def test_zombie_commit_in_flight_is_not_acknowledged(redis_target, tmp_path) -> None:
    """A zombie whose async checkpoint commits after the newer trainer restored gets
    its acknowledgement refused (raised by its next call), and the newer trainer's
    restores prefer its own generation's manifests over the zombie's late one."""
    spec = cf.create(redis_target.url, "tok", partitions=2)
    cf.fill(redis_target.url, spec, 60)
    a = _session(redis_target.url, tmp_path)
    state = _state()
    a.restore(state)
    it = iter(a.batches(DataLoader(a.dataset(batch_size=10), batch_size=None)))
    _take(it, 2)
    gen_a = a._gen()
    b = _session(redis_target.url, tmp_path)
    b.restore(_state())
    b.checkpoint(_state(), 1, blocking=True)  # B's lineage: step 1, nothing consumed
    # A passed its fence check before B restored; its commit lands now.
    a._check_fence = lambda gen: None  # type: ignore[method-assign]
    handle = a.checkpoint(state, 50)
    handle.wait()
    a.wait()
    with pytest.raises(FencedError, match="acknowledge refused"):
        a.checkpoint(state, 51)
    assert a.generation == gen_a
    c = _session(redis_target.url, tmp_path)
    assert c.restore(_state()) == 1  # B's step 1, not the zombie's step 50
    c.close()
    b.close()


def test_missing_dataset(redis_target, tmp_path) -> None:
    """A session for a dataset that does not exist fails at once, naming it."""
    with pytest.raises(DatasetNotFoundError, match="'tok' does not exist"):
        _session(redis_target.url, tmp_path)


def test_checkpoint_of_another_dataset(redis_target, tmp_path) -> None:
    """Restoring from a store whose newest checkpoint belongs to another dataset is
    refused with CheckpointMismatchError (a ValueError) naming both."""
    for name in ("tok", "other"):
        cf.fill(redis_target.url, cf.create(redis_target.url, name, partitions=2), 10)
    a = _session(redis_target.url, tmp_path, dataset="other")
    a.restore(_state())
    a.checkpoint(_state(), 1, blocking=True)
    a.close()
    b = _session(redis_target.url, tmp_path)
    with pytest.raises(CheckpointMismatchError, match="belongs to dataset 'other'") as info:
        b.restore(_state())
    assert isinstance(info.value, ValueError)


def test_partition_count_changed(redis_target, tmp_path) -> None:
    """A dataset recreated with another partition count cannot take the old offsets:
    PartitionCountError says both counts."""
    cf.fill(redis_target.url, cf.create(redis_target.url, "tok", partitions=4), 20)
    a = _session(redis_target.url, tmp_path)
    a.restore(_state())
    a.checkpoint(_state(), 1, blocking=True)
    a.close()
    client = redis_client.client(redis_target.url)
    client.delete(streams.meta_key("tok"))
    cf.create(redis_target.url, "tok", partitions=3)
    b = _session(redis_target.url, tmp_path)
    with pytest.raises(PartitionCountError, match=r"written for 4 partitions.*now has 3"):
        b.restore(_state())


@pytest.mark.parametrize("persistent", [False, True])
def test_rollback_rereads_from_the_checkpoint(any_redis, tmp_path, persistent: bool) -> None:
    """rollback() inside the loop reloads the weights of the checkpoint and the
    running batches() generator continues at its offsets: the records consumed after
    the checkpoint come again, once, and training then runs to the end (persistent
    workers too: their second pass starts at the seek recorded in Redis)."""
    spec = cf.create(any_redis.url, "tok", partitions=3)
    cf.fill(any_redis.url, spec, 150)
    s = _session(any_redis.url, tmp_path)
    state = _state()
    model = state["model"]
    assert isinstance(model, torch.nn.Linear)
    s.restore(state)
    loader = DataLoader(s.dataset(batch_size=6), batch_size=None, num_workers=2,
                        persistent_workers=persistent)
    it = iter(s.batches(loader))
    before = _take(it, 4)
    saved = model.weight.detach().clone()
    s.checkpoint(state, 4, blocking=True)
    after = _take(it, 3)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert s.rollback(state) == 4
    assert torch.equal(model.weight, saved)
    # The abandoned pass's workers may still read after the rollback moved the group
    # (tasks already queued to them); do the worst they could: move it to the end.
    client = redis_client.client(any_redis.url)
    for p in range(3):
        client.xgroup_setid(streams.partition_key("tok", p), "exp", "$")
    rest = list(it)
    assert set(_recs(after)) <= set(_recs(rest))
    assert sorted(_recs(before) + _recs(rest)) == list(range(150))
    s.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_deterministic_resume_yields_the_same_batches(redis_target, tmp_path, workers: int) -> None:
    """Deterministic mode: a run interrupted after 7 batches (an odd count, so the
    workers are out of phase) and resumed from its checkpoint yields exactly the batch
    sequence of an uninterrupted run, with partitions of unequal length."""
    spec = cf.create(redis_target.url, "tok", partitions=5)
    cf.fill(redis_target.url, spec, 233)

    def run(name: str, stop: int | None) -> list[list[str]]:
        s = _session(redis_target.url, tmp_path / name, run=name, deterministic=True)
        s.restore(_state())
        loader = DataLoader(s.dataset(batch_size=4), batch_size=None, num_workers=workers)
        out = []
        for i, b in enumerate(s.batches(loader)):
            out.append([f"{p}:{x}" for p, ids in b.ids.items() for x in ids])
            if stop is not None and i + 1 == stop:
                s.checkpoint(_state(), stop, blocking=True)
                break
        s.close()
        return out

    whole = run("whole", None)
    head = run("cut", 7)
    tail = run("cut", None)
    assert head + tail == whole
    assert len({x for b in whole for x in b}) == 233


@pytest.mark.parametrize(("workers_a", "workers_b"), [(2, 0), (0, 2)])
def test_restart_with_other_num_workers(redis_target, tmp_path, workers_a: int, workers_b: int) -> None:
    """A restart with another num_workers reassigns the partitions to other readers;
    checkpointed + re-read records are still every record once."""
    spec = cf.create(redis_target.url, "tok", partitions=5)
    cf.fill(redis_target.url, spec, 300)
    a = _session(redis_target.url, tmp_path)
    state = _state()
    a.restore(state)
    it = iter(a.batches(DataLoader(a.dataset(batch_size=7), batch_size=None, num_workers=workers_a)))
    first = _take(it, 9)
    a.checkpoint(state, 9, blocking=True)
    _take(it, 4)
    b = _session(redis_target.url, tmp_path)
    assert b.restore(_state()) == 9
    rest = list(b.batches(DataLoader(b.dataset(batch_size=7), batch_size=None, num_workers=workers_b)))
    assert sorted(_recs(first) + _recs(rest)) == list(range(300))
    b.close()


def test_damaged_newest_checkpoint_falls_back_with_its_offsets(redis_target, tmp_path) -> None:
    """When the newest checkpoint's data is damaged, restore loads the previous one and
    moves the group to *that* checkpoint's offsets: the records after them are read
    again, once."""
    spec = cf.create(redis_target.url, "tok", partitions=3)
    cf.fill(redis_target.url, spec, 120)
    a = _session(redis_target.url, tmp_path)
    state = _state()
    a.restore(state)
    it = iter(a.batches(DataLoader(a.dataset(batch_size=5), batch_size=None)))
    first = _take(it, 4)
    old = a.checkpoint(state, 4, blocking=True).wait()
    _take(it, 4)
    newest = a.checkpoint(state, 8, blocking=True).wait()
    a.close()
    chunks = [f for f in (tmp_path / "ckpt").rglob("*") if f.is_file() and newest.uid in str(f)
              and f.suffix != ".json" and "zarr.json" not in f.name]
    assert chunks
    for f in chunks:
        f.write_bytes(b"\xff" * max(1, f.stat().st_size))
    b = _session(redis_target.url, tmp_path)
    assert b.restore(_state()) == old.step
    rest = list(b.batches(DataLoader(b.dataset(batch_size=5), batch_size=None)))
    assert sorted(_recs(first) + _recs(rest)) == list(range(120))
    b.close()


def test_cancelled_blocking_read_loses_and_repeats_nothing(redis_target, tmp_path) -> None:
    """An endless dataset's blocking read is cut off by an exception (as a signal
    handler or a timeout would); the next pass starts at the consumed offsets on a
    fresh connection, and every record arrives once."""
    import signal

    spec = cf.create(redis_target.url, "live", partitions=2, epochs=None)
    cf.fill(redis_target.url, spec, 40, finish=False)
    s = _session(redis_target.url, tmp_path, dataset="live", block_ms=2000)
    s.restore(_state())
    ds = s.dataset(batch_size=10)
    got: list[Batch] = []

    class Cancelled(Exception):
        pass

    def cancel(signum, frame):  # type: ignore[no-untyped-def]
        raise Cancelled

    old = signal.signal(signal.SIGALRM, cancel)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(Cancelled):
            for b in s.batches(DataLoader(ds, batch_size=None)):
                got.append(b)  # 4 batches, then blocked in XREAD until the alarm
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert sorted(_recs(got)) == list(range(40))
    cf.fill(redis_target.url, spec, 80, start=40, finish=False)
    it = iter(s.batches(DataLoader(ds, batch_size=None)))
    more = _take(it, 4)
    assert sorted(_recs(got + more)) == list(range(80))
    s.close()


def test_retention_floor_is_below_every_kept_checkpoint(redis_target, tmp_path) -> None:
    """keep_last=2 and four checkpoints: the published retention floor is at or below
    the offsets of every checkpoint the store keeps (rolling back to any of them finds
    its records untrimmed) and above those of the first, deleted one (it advances)."""
    spec = cf.create(redis_target.url, "tok", partitions=3)
    cf.fill(redis_target.url, spec, 300)
    s = _session(redis_target.url, tmp_path, keep_last=2)
    state = _state()
    s.restore(state)
    it = iter(s.batches(DataLoader(s.dataset(batch_size=5), batch_size=None)))
    first: dict[int, str] = {}
    for step in range(1, 5):
        _take(it, 3)
        m = s.checkpoint(state, step, blocking=True).wait()
        if step == 1:
            first = checkpoint_offsets(s.store, m)
    client = redis_client.client(redis_target.url)
    floor = streams.offsets_from_wire(client.hgetall(streams.floor_key("tok", "exp")))
    kept = s.store.list()
    assert 1 not in {m.step for m in kept}
    for m in kept:
        offs = checkpoint_offsets(s.store, m)
        assert all(streams.parse_id(floor[p]) <= streams.parse_id(offs[p]) for p in range(3))
    assert any(streams.parse_id(floor[p]) > streams.parse_id(first[p]) for p in range(3))
    s.close()


class _KillsRedisAfterSave(CheckpointStore):
    """A real local store that, on the first ``list()`` after a save returned (the
    session's publish step, between acknowledging and publishing), pauses Redis' writes
    and SIGKILLs and restarts it 0.3 s later: the publish is cut off mid-call."""

    def __init__(self, url: str, server: RedisServer) -> None:
        super().__init__(url)
        self.server = server
        self.armed = False
        self.bouncer: threading.Timer | None = None

    def save(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().save(*args, **kwargs)
        self.armed = True
        return handle

    def list(self) -> list[Any]:
        out = super().list()
        if self.armed:
            self.armed = False
            redis_client.client(self.server.url).client_pause(10_000, all=False)
            self.bouncer = threading.Timer(0.3, self.server.restart)
            self.bouncer.start()
        return out


def test_offsets_published_when_redis_dies_during_publish(redis_factory, tmp_path) -> None:
    """Redis dies while the session publishes the committed offsets and the floor (one
    MULTI) and comes back empty: the publish is retried and lands in full (a retry of
    the same redis-py pipeline would send nothing, as a failed execute() empties it)."""
    server = redis_factory()
    spec = cf.create(server.url, "tok", partitions=2)
    cf.fill(server.url, spec, 20)
    store = _KillsRedisAfterSave(f"file://{tmp_path}/ckpt", server)
    s = TrainingSession(server.url, dataset="tok", run="exp", store=store, block_ms=100)
    state = _state()
    s.restore(state)
    list(s.batches(DataLoader(s.dataset(batch_size=5), batch_size=None)))
    s.checkpoint(state, 1, blocking=True)
    assert store.bouncer is not None
    store.bouncer.join()
    s.close()
    ends = {p: streams.make_id(0, 9) for p in range(2)}
    client = redis_client.client(server.url)
    assert streams.offsets_from_wire(client.hgetall(streams.committed_key("tok", "exp"))) == ends
    assert streams.offsets_from_wire(client.hgetall(streams.floor_key("tok", "exp"))) == ends


def test_checkpoints_come_in_restore_order(redis_target, tmp_path) -> None:
    """checkpoints() lists the run's committed checkpoints newest (generation, commit,
    step) first: after checkpoints of steps 1, 2, 3 and a rollback to step 1, the new
    lineage's step 2 comes before the abandoned step 3, and a restart restores it."""
    spec = cf.create(redis_target.url, "tok", partitions=2)
    cf.fill(redis_target.url, spec, 20)
    s = _session(redis_target.url, tmp_path, keep_last=10)
    state = _state()
    s.restore(state)
    for step in (1, 2, 3):
        s.checkpoint(state, step, blocking=True)
    assert s.rollback(state, 1) == 1
    s.checkpoint(state, 2, blocking=True)
    order = [(m.step, m.extra["trainguard"]["commit"]) for m in s.checkpoints()]
    assert order == [(2, 4), (3, 3), (2, 2), (1, 1)]
    s.close()
    again = _session(redis_target.url, tmp_path, keep_last=10)
    assert again.restore(_state()) == 2
    again.close()


def test_health_from_a_probe_or_the_attached_monitor(redis_target, tmp_path) -> None:
    """session.health(): without a monitor, a probe now (fake NVML without GPUs: no
    GPU, OK); with a monitor attached at construction, the monitor's report (a fake
    GPU with an uncorrected ECC error: CRITICAL), probed once and then reused."""
    from tests._fake_nvml import FakeGpu, FakeNvml
    from trainer_client.health import HealthMonitor, HealthProbe, Status

    cf.create(redis_target.url, "tok", partitions=1)
    bare = _session(redis_target.url, tmp_path)
    report = bare.health(probe=HealthProbe(nvml=FakeNvml([])))
    assert report.no_gpu and report.status is Status.OK and report.gpus == ()
    bare.close()
    nvml = FakeNvml([FakeGpu(ecc_uncorrected=1)])
    monitor = HealthMonitor(HealthProbe(nvml=nvml), interval_s=3600)
    watched = _session(redis_target.url, tmp_path, health_monitor=monitor)
    report = watched.health()
    assert len(report.gpus) == 1 and report.status is Status.CRITICAL
    assert monitor.latest is report and watched.health() is report
    assert nvml.initialized == 1
    watched.close()
