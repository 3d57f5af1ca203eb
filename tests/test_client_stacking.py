"""Batch tensors from Redis replies: exact bytes, and in a DataLoader worker built in
shared memory from the start (torch then sends them to the main process without
copying them into shared memory itself)."""

from __future__ import annotations

import numpy as np
import torch

from trainer_client._stacking import shared_empty, stack_arrays
from trainguard.core import streams


def _flats(arrays: list[np.ndarray]) -> list[list[bytes]]:
    """Field lists as Redis replies carry them: ``[name, value, name, value, ...]``."""
    return [[x for kv in streams.encode_record(a).items() for x in kv] for a in arrays]


def test_worker_batch_lives_in_shared_memory_with_the_exact_bytes():
    """In a worker the batch tensor's storage is shared memory from the start, and it
    holds every record's bytes in order; in the main process it is ordinary memory."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 2**31, (4, 3), dtype=np.int32) for _ in range(5)]
    worker = stack_arrays(_flats(arrays), in_worker=True)
    main = stack_arrays(_flats(arrays), in_worker=False)
    want = torch.from_numpy(np.stack(arrays))
    assert worker is not None and main is not None
    assert worker.is_shared() and not main.is_shared()
    assert worker.dtype == torch.int32 and tuple(worker.shape) == (5, 4, 3)
    assert torch.equal(worker, want) and torch.equal(main, want)


def test_shared_empty_has_the_shape_dtype_and_size_asked_for():
    """No larger allocation behind it, for any dtype (bfloat16 has no NumPy twin)."""
    for dtype in (torch.uint8, torch.bfloat16, torch.float64):
        t = shared_empty((3, 5), dtype)
        assert t.is_shared() and t.dtype == dtype and tuple(t.shape) == (3, 5)
        assert t.untyped_storage().nbytes() == 15 * t.element_size()
        t.fill_(1)
        assert bool((t == 1).all())


def test_zero_sized_records_stack_to_an_empty_batch():
    arrays = [np.zeros((0, 2), dtype=np.float32) for _ in range(3)]
    out = stack_arrays(_flats(arrays), in_worker=True)
    assert out is not None and tuple(out.shape) == (3, 0, 2)
