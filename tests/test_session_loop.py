"""The training loop as ML engineers write it: each trap found by training a real model
through a session (issue 15) is either the right behaviour now or a clear error, with
nothing committed wrongly. One test per trap, numbered as in the issue:

1. resume restores the random states, and reading leaves them untouched; LR
   schedulers and other ``Stateful`` values come back with the weights;
2. deterministic mode is the default;
3. iterating the loader instead of ``session.batches()`` is refused;
4. epochs: batches never straddle one (unless asked), the epoch change is flagged,
   steps-per-epoch is known up front, ``drop_last`` consumes short tails;
5. ``progress()`` says where the loop stands in its epoch;
6. every batch carries its records' source positions (``pos``);
7. ``rollback()`` with nothing to roll back to raises and changes nothing;
9. ``TrainingSession.inspect`` reads a checkpoint without fencing the live trainer.

(8, ranks with uneven data, is ``tests/test_readme_loop.py`` and
``tests/test_session_ranks.py``.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ingest_service import redis_client as ingest_redis
from tests import _client_fill as cf
from trainer_client import (
    Batch,
    NoRollbackTargetError,
    SessionBypassedError,
    StreamingDataset,
    TrainingSession,
)
from trainer_client import redis_client as trainer_redis
from trainguard.core import streams


def _session(url: str, tmp: Path, **kw: Any) -> TrainingSession:
    kw.setdefault("dataset", "tok")
    kw.setdefault("run", "exp")
    kw.setdefault("block_ms", 100)
    return TrainingSession(url, store=f"file://{tmp}/ckpt", **kw)


def _restored(url: str, tmp: Path, n: int, partitions: int) -> tuple[TrainingSession, dict[str, Any]]:
    """A dataset of ``n`` records over ``partitions``, and a restored session on it."""
    spec = cf.create(url, "tok", partitions=partitions)
    cf.fill(url, spec, n)
    s = _session(url, tmp)
    state = _state()
    s.restore(state)
    return s, state


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched}


def _step(state: dict[str, Any], batch: Batch) -> float:
    x = batch.data.float() / 100
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()
    return float(loss.detach())


def _recs(batches: list[Batch]) -> list[int]:
    return [int(i) for b in batches for i in b.data[:, 0].tolist()]


def fill_epochs(url: str, spec: streams.DatasetSpec, n: int, epochs: int,
                make: Callable[[int], Any] = cf.record) -> None:
    """``epochs`` passes over records ``make(0..n-1)`` (record ``i`` in partition
    ``i % P``), each with its source position ``src.npy:<8 i>``, then the producer's
    end marks."""
    P = spec.partitions
    client = trainer_redis.client(url)
    pipe = client.pipeline(transaction=False)
    for e in range(epochs):
        for i in range(n):
            pipe.xadd(streams.partition_key(spec.name, i % P),
                      streams.encode_record(make(i), pos=f"src.npy:{8 * i}"),
                      id=streams.make_id(e, i // P))
    pipe.execute()
    ends = {streams.progress_end_field(p): streams.make_id(epochs - 1, len(range(p, n, P)) - 1)
            for p in range(P)}
    client.hset(streams.progress_key(spec.name),
                mapping={**ends, streams.PROGRESS_EPOCHS_DONE: str(epochs),
                         streams.PROGRESS_FINISHED: b"1"})
    client.close()


# ----------------------------------------------------------------------- 1. RNG, Stateful


def test_resume_restores_random_states_and_reading_leaves_them_alone(redis_target, tmp_path) -> None:
    """After restore(), torch's, NumPy's and Python's generators continue exactly as
    they would have after the checkpoint, the LR scheduler and a user's Stateful
    object are back, and iterating the DataLoader (2 workers) through batches() draws
    nothing from the global generator."""
    spec = cf.create(redis_target.url, "tok", partitions=2)
    cf.fill(redis_target.url, spec, 64)

    class Counter:  # any object with state_dict/load_state_dict
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, d: dict[str, int]) -> None:
            self.n = d["n"]

    a = _session(redis_target.url, tmp_path)
    state, counter = _state(), Counter()
    state["counter"] = counter
    a.restore(state)
    it = iter(a.batches(DataLoader(a.dataset(batch_size=4), batch_size=None, num_workers=2)))
    for _ in range(3):
        _step(state, next(it))
        counter.n += 1
    a.checkpoint(state, 3, blocking=True)
    want = (torch.rand(4), np.random.rand(3), random.random())
    lr = state["optim"].param_groups[0]["lr"]
    a.close()

    torch.manual_seed(123), np.random.seed(123), random.seed(123)  # a fresh process
    b = _session(redis_target.url, tmp_path)
    state2, counter2 = _state(), Counter()
    state2["counter"] = counter2
    assert b.restore(state2) == 3
    before = torch.get_rng_state()
    it = iter(b.batches(DataLoader(b.dataset(batch_size=4), batch_size=None, num_workers=2)))
    next(it)
    assert torch.equal(torch.get_rng_state(), before), "iterating the loader drew from the RNG"
    torch.set_rng_state(before)
    got = (torch.rand(4), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert state2["sched"].last_epoch == 3 and state2["optim"].param_groups[0]["lr"] == lr
    assert counter2.n == 3
    b.close()


# ----------------------------------------------------------------------- 2. deterministic default


def test_deterministic_is_the_default_and_resumes_batch_for_batch(any_redis, tmp_path) -> None:
    """A session made without options is deterministic: a run stopped after 5 of its
    batches and resumed yields the batches an uninterrupted run yields, in order."""
    spec = cf.create(any_redis.url, "tok", partitions=3)
    cf.fill(any_redis.url, spec, 90)

    def run(name: str, stop: int | None) -> list[list[str]]:
        s = _session(any_redis.url, tmp_path / name, run=name)
        assert s.deterministic
        s.restore(_state())
        out = []
        for i, b in enumerate(s.batches(DataLoader(s.dataset(batch_size=4), batch_size=None,
                                                   num_workers=2))):
            out.append([x for ids in b.ids.values() for x in ids])
            if i + 1 == stop:
                s.checkpoint(_state(), stop, blocking=True)
                break
        s.close()
        return out

    whole = run("whole", None)
    assert run("cut", 5) + run("cut", None) == whole


# ----------------------------------------------------------------------- 3. bypass


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_the_loader_directly_is_refused(redis_target, tmp_path, workers: int) -> None:
    """The loop iterates the DataLoader instead of session.batches(loader): the first
    batch raises SessionBypassedError saying what to do, and nothing is committed."""
    s, _ = _restored(redis_target.url, tmp_path, 40, 2)
    loader = DataLoader(s.dataset(batch_size=4), batch_size=None, num_workers=workers)
    with pytest.raises(SessionBypassedError, match=r"session\.batches\(loader\)"):
        next(iter(loader))
    assert s.checkpoints() == []
    s.close()


def test_checkpoint_after_reading_around_the_session_is_refused(redis_target, tmp_path) -> None:
    """Records read by a StreamingDataset the session did not make (same run and
    generation), with no batches() pass: checkpoint() raises SessionBypassedError and
    commits nothing; a restart then reads every record."""
    s, state = _restored(redis_target.url, tmp_path, 40, 2)
    ds = StreamingDataset(redis_target.url, "tok", "exp", batch_size=4, generation=s.generation or 0)
    taken = [b for _, b in zip(range(3), iter(ds))]
    assert len(taken) == 3
    with pytest.raises(SessionBypassedError, match="checkpoint refused"):
        s.checkpoint(state, 3, blocking=True)
    s.close()
    assert s.checkpoints() == []
    b = _session(redis_target.url, tmp_path)
    b.restore(_state())
    assert sorted(_recs(list(b.batches(DataLoader(b.dataset(batch_size=4), batch_size=None))))) == list(range(40))
    b.close()


# ----------------------------------------------------------------------- 4, 5, 6. epochs, progress, pos


@pytest.mark.parametrize("deterministic", [True, False])
def test_epochs_are_cut_flagged_and_counted(redis_target, tmp_path, deterministic: bool) -> None:
    """Two epochs of 30 records over 3 partitions, batches of 4, 2 workers: no batch
    holds two epochs, new_epoch marks exactly the first batch of each epoch, and
    progress() predicted the steps of an epoch before the first batch; at the end of
    epoch 0 it reports every record of it consumed, none remaining."""
    spec = cf.create(redis_target.url, "tok", partitions=3, epochs=2)
    fill_epochs(redis_target.url, spec, 30, 2)
    s = _session(redis_target.url, tmp_path, deterministic=deterministic)
    s.restore(_state())
    ds = s.dataset(batch_size=4)
    before = s.progress()
    assert (before.epoch, before.batches, before.records, before.remaining) == (0, 0, 0, 30)
    assert before.exact and before.epochs == 2
    got = list(s.batches(DataLoader(ds, batch_size=None, num_workers=2)))
    epochs = [b.epoch for b in got]
    assert all(len({streams.id_epoch_index(i)[0] for ids in b.ids.values() for i in ids}) == 1
               for b in got)
    # With several workers, one may start epoch 1 while another ends epoch 0: the flag
    # marks the first batch of each new epoch.
    assert [b.new_epoch for b in got] == [i == 0 or epochs[i] > max(epochs[:i]) for i in range(len(got))]
    assert sum(b.new_epoch for b in got) == 2
    per_epoch = [epochs.count(0), epochs.count(1)]
    assert per_epoch[0] == per_epoch[1] == before.steps_per_epoch
    after = s.progress()
    assert (after.epoch, after.batches, after.records, after.remaining) == (1, per_epoch[1], 30, 0)
    assert sorted(_recs(got)) == sorted(list(range(30)) * 2)
    s.close()


def test_progress_mid_epoch_and_after_a_restart(redis_target, tmp_path) -> None:
    """Mid-epoch, progress() counts this epoch's batches and records and the records
    left; a restart from a checkpoint reports the same numbers."""
    spec = cf.create(redis_target.url, "tok", partitions=2, epochs=2)
    fill_epochs(redis_target.url, spec, 40, 2)
    s = _session(redis_target.url, tmp_path)
    state = _state()
    s.restore(state)
    it = iter(s.batches(DataLoader(s.dataset(batch_size=5), batch_size=None)))
    for _ in range(10):  # epoch 0 is 8 batches: these are 2 batches into epoch 1
        next(it)
    p = s.progress()
    assert (p.epoch, p.batches, p.records, p.remaining, p.steps_per_epoch) == (1, 2, 10, 30, 8)
    s.checkpoint(state, 10, blocking=True)
    s.close()
    b = _session(redis_target.url, tmp_path)
    b.dataset(batch_size=5)  # before restore: sizes an LR schedule from progress()
    b.restore(_state())
    assert b.progress() == p
    b.close()


def test_drop_last_consumes_short_tails_without_training_them(redis_target, tmp_path) -> None:
    """drop_last: an epoch's short last batch is never yielded, yet counts as consumed
    (a restart does not read it again); straddle_epochs fills batches across epochs."""
    spec = cf.create(redis_target.url, "tok", partitions=1, epochs=2)
    fill_epochs(redis_target.url, spec, 10, 2)
    s = _session(redis_target.url, tmp_path)
    state = _state()
    s.restore(state)
    got = list(s.batches(DataLoader(s.dataset(batch_size=4, drop_last=True), batch_size=None)))
    assert [len(b) for b in got] == [4, 4, 4, 4] and s.progress().steps_per_epoch == 2
    s.checkpoint(state, 4, blocking=True)
    s.close()
    b = _session(redis_target.url, tmp_path)
    b.restore(_state())
    assert list(b.batches(DataLoader(b.dataset(batch_size=4), batch_size=None))) == []
    b.close()
    c = _session(redis_target.url, tmp_path / "c", run="c")
    c.restore(_state())
    straddled = list(c.batches(DataLoader(c.dataset(batch_size=4, straddle_epochs=True),
                                          batch_size=None)))
    assert [len(x) for x in straddled] == [4, 4, 4, 4, 4] and straddled[2].epoch == 0
    c.close()


@pytest.mark.parametrize("kind", ["nd", "mp"])
def test_every_batch_carries_source_positions(redis_target, tmp_path, kind: str) -> None:
    """Batch.pos lists each record's source position in the order of batch.data, for
    the NumPy fast path (one tensor) and for decoded records alike."""
    spec = cf.create(redis_target.url, "tok", partitions=2)
    client = trainer_redis.client(redis_target.url)
    for i in range(12):
        value: Any = cf.record(i) if kind == "nd" else {"i": i}
        client.xadd(streams.partition_key("tok", i % 2),
                    streams.encode_record(value, pos=f"data/a.npy:{8 * i}"),
                    id=streams.make_id(0, i // 2))
    cf.mark_finished(client, spec, 12)
    s = _session(redis_target.url, tmp_path)
    s.restore(_state())
    for b in s.batches(DataLoader(s.dataset(batch_size=3), batch_size=None, num_workers=2)):
        rows = b.data[:, 0].tolist() if kind == "nd" else [r["i"] for r in b.data]
        assert b.pos == [f"data/a.npy:{8 * i}" for i in rows]
    s.close()


# ----------------------------------------------------------------------- 7. rollback


def test_rollback_without_a_checkpoint_raises_and_changes_nothing(redis_target, tmp_path) -> None:
    """64 records, 1 partition: after 3 batches, rollback() with no committed
    checkpoint raises NoRollbackTargetError; weights and offsets stay, and finishing
    the run trains every record exactly once."""
    s, state = _restored(redis_target.url, tmp_path, 64, 1)
    it = iter(s.batches(DataLoader(s.dataset(batch_size=8), batch_size=None)))
    first = [next(it) for _ in range(3)]
    weights = [p.detach().clone() for p in state["model"].parameters()]
    offsets = s.offsets
    with pytest.raises(NoRollbackTargetError, match="no committed checkpoint"):
        s.rollback(state)
    assert s.offsets == offsets
    assert all(torch.equal(a, b) for a, b in zip(weights, state["model"].parameters()))
    rest = list(it)
    assert sorted(_recs(first + rest)) == list(range(64))
    s.close()


# ----------------------------------------------------------------------- 9. inspect


def test_inspect_reads_a_checkpoint_without_fencing_the_trainer(redis_target, tmp_path) -> None:
    """An evaluation script inspects the run's newest checkpoint while the trainer
    runs: it gets the weights and the session record, and the trainer goes on reading
    and checkpointing (no new generation was taken, nothing moved)."""
    s, state = _restored(redis_target.url, tmp_path, 80, 2)
    it = iter(s.batches(DataLoader(s.dataset(batch_size=4), batch_size=None, num_workers=2)))
    for _ in range(4):
        _step(state, next(it))
    s.checkpoint(state, 4, blocking=True)
    generation = s.generation

    evaluated = _state()
    m = TrainingSession.inspect(f"file://{tmp_path}/ckpt", evaluated)
    assert m.step == 4 and m.extra["trainguard"]["generation"] == generation
    for a, b in zip(state["model"].parameters(), evaluated["model"].parameters()):
        assert torch.equal(a, b)

    rest = list(it)  # the trainer is not fenced
    s.checkpoint(state, 4 + len(rest), blocking=True)
    assert s.generation == generation
    s.close()
    with pytest.raises(LookupError):
        TrainingSession.inspect(f"file://{tmp_path}/empty", _state())


# ----------------------------------------------------------------------- 4. epochs on demand


def test_the_trainer_asks_for_epochs_and_the_producer_writes_them_as_they_drain(
    redis_target, tmp_path
) -> None:
    """An endless npy dataset (ingested once, no epoch count), backlog bounded to one
    epoch: the real producer writes epochs only as the trainer commits, and
    ``session.dataset(epochs=3)`` trains exactly 3 epochs, each record once per
    epoch, then ends. (The run's group exists before the first record: the producer
    must start at epoch 0 of the empty stream the group made.) Asking a finite
    dataset for more epochs than it has is a clear error."""
    import asyncio
    import threading

    from ingest_service.backlog import BacklogLimits
    from ingest_service.datasets import create_dataset
    from ingest_service.producer.producer import Producer

    n, P = 64, 2
    np.save(tmp_path / "tokens.npy", np.repeat(np.arange(n, dtype=np.int64), 8))
    spec = streams.DatasetSpec(name="endless", partitions=P, source=f"file://{tmp_path}/tokens.npy",
                               format="npy", sample_len=8, epochs=None)

    async def register() -> None:
        client = ingest_redis.client(redis_target.url)
        try:
            await create_dataset(client, spec)
        finally:
            await client.aclose()

    asyncio.run(register())
    s = _session(redis_target.url, tmp_path, dataset="endless")
    state = _state()
    s.restore(state)  # the run's group exists before the producer starts
    producer_box: list[Producer] = []
    loop = asyncio.new_event_loop()

    async def produce() -> None:
        redis_client = ingest_redis.client(redis_target.url)
        producer = Producer(redis_client, spec, batch_records=8,
                            limits=BacklogLimits(max_entries=n // P, poll_interval_s=0.02),
                            maintenance_interval_s=0.05)
        producer_box.append(producer)
        try:
            await producer.run()
        finally:
            await redis_client.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(produce(),), daemon=True)
    thread.start()
    seen: list[int] = []
    step = 0
    for batch in s.batches(DataLoader(s.dataset(batch_size=8, epochs=3), batch_size=None)):
        seen += [int(i) for i in batch.data[:, 0].tolist()]
        step += 1
        if step % 2 == 0:
            s.checkpoint(state, step, blocking=True)  # commits let the producer go on
    s.checkpoint(state, step, blocking=True)
    assert sorted(seen) == sorted(list(range(n)) * 3)
    assert s.progress().epochs == 3
    sync = trainer_redis.client(redis_target.url)
    produced = max(streams.parse_id(sync.xrevrange(streams.partition_key("endless", p), count=1)[0][0])[0]
                   for p in range(P))
    assert 3 <= produced <= 5, f"the producer ran {produced} epochs ahead of a 3-epoch trainer"
    loop.call_soon_threadsafe(producer_box[0].stop)
    thread.join(30)
    s.close()
    sync.close()

    finite = cf.create(redis_target.url, "two", partitions=1, epochs=2)
    t = _session(redis_target.url, tmp_path / "t", dataset=finite.name)
    with pytest.raises(ValueError, match=r"epochs=3 is not available.*has 2 epochs"):
        t.dataset(batch_size=4, epochs=3)
    t.close()


def test_random_augmentation_in_workers_is_the_same_on_a_resume(redis_target, tmp_path) -> None:
    """A collate that adds random noise (drawn in the DataLoader workers) produces, in a
    resumed run, bitwise the batches of an uninterrupted run: workers draw from
    generators seeded per batch from the run seed, not from the worker's lineage."""
    spec = cf.create(redis_target.url, "tok", partitions=3)
    cf.fill(redis_target.url, spec, 90)

    def noisy(records: list[Any]) -> torch.Tensor:
        return torch.from_numpy(np.stack(records)).float() + torch.rand(len(records), 8)

    def run(name: str, stop: int | None, workers: int) -> list[torch.Tensor]:
        s = _session(redis_target.url, tmp_path / name, run=name, seed=7)
        s.restore(_state())
        loader = DataLoader(s.dataset(batch_size=4, collate=noisy), batch_size=None,
                            num_workers=workers)
        out = []
        for i, b in enumerate(s.batches(loader)):
            out.append(b.data)
            if i + 1 == stop:
                s.checkpoint(_state(), stop, blocking=True)
                break
        s.close()
        return out

    whole = run("whole", None, 2)
    resumed = run("cut", 5, 2) + run("cut", None, 2)
    assert len(whole) == len(resumed) and all(torch.equal(a, b) for a, b in zip(whole, resumed))


def test_a_checkpoint_of_record_version_1_still_resumes(redis_target, tmp_path) -> None:
    """A checkpoint written before random states were saved (session record version
    1) restores: weights and offsets come back, the random states are left as they
    are, and the run then reads exactly the records after the offsets."""
    from checkpoint_store import CheckpointStore

    s, state = _restored(redis_target.url, tmp_path, 40, 2)
    s.close()
    v1 = {"trainguard": {"version": 1, "dataset": "tok", "run": "exp", "partitions": 2,
                         "generation": 1, "commit": 1, "world_size": 1, "num_workers": 0,
                         "offsets": {"0": "1-9", "1": "1-9"}, "batches": {"0": 0, "1": 0}}}
    with torch.no_grad():
        state["model"][0].weight.add_(1.0)  # unlike a fresh _state()
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    store.save(state, step=5, extra=v1, blocking=True)
    store.close()
    b = _session(redis_target.url, tmp_path)
    target = _state()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert b.restore(target) == 5
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(target["model"].parameters(),
                                                  state["model"].parameters()))
    rest = list(b.batches(DataLoader(b.dataset(batch_size=4), batch_size=None)))
    assert sorted(_recs(rest)) == list(range(20, 40))  # records 0..19 are at or below 1-9
    b.close()
