"""DataLoader workers' batch rings against a real redis-server: every record exactly
once through the ring, and a slot is never refilled while the training loop still
holds a tensor viewing it (the loop may hold any number of batches)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests import _client_fill as cf
from trainer_client import _batch_ring
from trainer_client._stacking import stack_arrays
from trainer_client.dataset import Batch, StreamingDataset
from trainguard.core import streams

P = 4


def _expected(b: Batch) -> list[int]:
    """The record numbers a batch must hold, from its IDs (record i is partition
    i % P's (i // P)-th entry)."""
    return sorted(streams.parse_id(i)[1] * P + p for p, ids in b.ids.items() for i in ids)


def _check(b: Batch) -> None:
    """The batch tensor holds exactly its own records (each row is ``[i] * width``)."""
    rows = b.data.numpy()
    assert (rows == rows[:, :1]).all(), "a row mixes two records: the slot was overwritten"
    assert sorted(rows[:, 0].tolist()) == _expected(b)


@pytest.mark.parametrize("persistent", [False, True])
def test_every_record_once_through_the_ring(redis_server, persistent: bool) -> None:
    """Two workers, two passes (a second group): each pass yields every record exactly
    once, each batch holds exactly the records its IDs name, and batches really came
    through ring slots, which were reused (more batches than slots)."""
    spec = cf.create(redis_server.url, "tok", partitions=P, sample_len=16)
    n = 3000
    cf.fill(redis_server.url, spec, n, make=lambda i: cf.record(i, 16))
    for group in ("a", "b"):
        ds = StreamingDataset(redis_server.url, "tok", group, batch_size=10)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
        seen: Counter[int] = Counter()
        slots: set[tuple[str, int]] = set()
        batches = 0
        for b in loader:
            _check(b)
            seen.update(b.data[:, 0].tolist())
            slot = _batch_ring.slot_of(b.data)
            assert slot is not None, "a batch the loop dropped at once came from beside the ring"
            slots.add(slot)
            batches += 1
            del b
        assert seen == Counter(range(n))
        assert batches > 2 * _batch_ring.RING_SLOTS and len(slots) <= 2 * _batch_ring.RING_SLOTS


def test_a_held_batch_is_never_overwritten(redis_server) -> None:
    """The loop keeps a window of random depth (0 to 3x the ring) of past batches and
    checks each one again when it lets it go, and keeps some for the whole pass
    (including slices): every batch still holds exactly its own records, however long
    it was held; batches beyond the ring's depth come from beside it."""
    spec = cf.create(redis_server.url, "tok", partitions=P, sample_len=8)
    n = 4000
    cf.fill(redis_server.url, spec, n)
    ds = StreamingDataset(redis_server.url, "tok", "run", batch_size=8)
    rng = random.Random(7)
    window: list[Batch] = []
    kept: list[tuple[Batch, torch.Tensor]] = []
    seen: Counter[int] = Counter()
    beside = 0
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        _check(b)
        seen.update(b.data[:, 0].tolist())
        beside += _batch_ring.slot_of(b.data) is None
        if rng.random() < 0.05:
            kept.append((b, b.data[1:3]))  # a slice alone must hold the slot too
            b = Batch(data=b.data[1:3].clone(), ids={}, offsets={})
        window.append(b)
        depth = rng.randrange(3 * _batch_ring.RING_SLOTS)
        while len(window) > depth:
            old = window.pop(0)
            if old.ids:
                _check(old)
    for b in window:
        if b.ids:
            _check(b)
    for b, part in kept:
        whole = b.data.clone()
        del b.data  # only the slice still views the slot
        assert torch.equal(part, whole[1:3])
        assert (part == part[:, :1]).all()
    assert seen == Counter(range(n))
    assert beside > 0, "the window never outgrew the ring: the test did not test holding"


def test_stacking_in_a_worker_takes_a_slot_and_then_falls_back(monkeypatch) -> None:
    """In a worker (here: this process, with a ring of its own), batches fill ring
    slots with the exact bytes until every slot is taken, then come from beside the
    ring (a fresh shared tensor) with the same bytes."""
    monkeypatch.setattr(_batch_ring, "_rings", {})  # this process's ring, fresh
    arrays = [np.arange(i, i + 6, dtype=np.float32).reshape(2, 3) for i in range(5)]
    flats = [[x for kv in streams.encode_record(a).items() for x in kv] for a in arrays]
    want = torch.from_numpy(np.stack(arrays))
    held = []
    for _ in range(_batch_ring.RING_SLOTS):
        t = stack_arrays(flats, in_worker=True)
        assert _batch_ring.is_ring_tensor(t) and torch.equal(t, want)
        held.append(t)
    t = stack_arrays(flats, in_worker=True)
    assert t is not None and not _batch_ring.is_ring_tensor(t) and t.is_shared()
    assert torch.equal(t, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pin_memory_pins_ring_batches(redis_server) -> None:
    """DataLoader(pin_memory=True): each batch arrives pinned, with its own records."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, 500)
    ds = StreamingDataset(redis_server.url, "tok", "run", batch_size=10)
    seen: Counter[int] = Counter()
    for b in DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True):
        assert b.data.is_pinned()
        _check(b)
        seen.update(b.data[:, 0].tolist())
    assert seen == Counter(range(500))


def test_only_multiprocessing_sends_a_slot_handle(monkeypatch) -> None:
    """``pickle`` and ``copy`` of a worker's batch keep its data a tensor with its
    bytes (a handle would be meaningless to them); only multiprocessing's pickler (the
    DataLoader's queues) sends the slot's handle, which unpickles to a view of it."""
    import copy
    import pickle
    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setattr(_batch_ring, "_rings", {})
    flats = [[x for kv in streams.encode_record(cf.record(i, 512)).items() for x in kv]
             for i in range(4)]
    data = stack_arrays(flats, in_worker=True)
    assert _batch_ring.is_ring_tensor(data)
    b = Batch(data=data, ids={0: ["1-0"]}, offsets={0: "1-0"})
    for other in (copy.copy(b), copy.deepcopy(b), pickle.loads(pickle.dumps(b))):
        assert isinstance(other.data, torch.Tensor) and torch.equal(other.data, data)
    sent = bytes(ForkingPickler.dumps(b))
    assert len(sent) < data.numel() * data.element_size()  # the bytes did not travel
    got = pickle.loads(sent)
    assert _batch_ring.slot_of(got.data) is not None and torch.equal(got.data, data)
    assert got.ids == b.ids
