"""Asynchronous saves: staged state is a snapshot, one save in flight, background
failures are never lost, callbacks run after the commit, buffers are reused."""

from __future__ import annotations

import errno
import threading
import uuid

import pytest
import torch

from checkpoint_store import (
    CheckpointError,
    CheckpointStore,
    CheckpointWriteError,
    SaveHandle,
    SaveInProgressError,
)
from tests._ckpt_fs import PROTOCOL, limited_store_options
from tests._ckpt_helpers import state_for


def _gated_store(gate: threading.Event, **kwargs) -> CheckpointStore:
    return CheckpointStore(f"{PROTOCOL}://run-{uuid.uuid4().hex}",
                           storage_options=limited_store_options(gate=gate, **kwargs))


def test_async_save_is_a_snapshot_of_the_state_at_call_time(tmp_path):
    """After save(blocking=False) returns, training may change the tensors in place:
    the checkpoint holds the values at the call (they were staged)."""
    store = CheckpointStore(tmp_path / "c")
    w = torch.arange(1000, dtype=torch.float32)
    state = {"w": w, "step": 7}
    handle = store.save(state, step=7, blocking=False)
    w.add_(1000)
    state["step"] = 8
    manifest = handle.wait()
    assert manifest.step == 7 and handle.done() and handle.manifest is manifest
    target = {"w": torch.zeros(1000), "step": 0}
    store.load(target)
    assert torch.equal(target["w"], torch.arange(1000, dtype=torch.float32))
    assert target["step"] == 7


def test_one_save_in_flight_wait_or_refuse():
    """While a save is being written, save(if_busy='raise') raises
    SaveInProgressError and save(if_busy='wait') waits for it; both then commit in
    order and the second manifest's parent is the first."""
    gate = threading.Event()
    store = _gated_store(gate)
    first = store.save(state_for(1), step=1, blocking=False)
    assert not first.done()
    with pytest.raises(SaveInProgressError):
        store.save(state_for(2), step=2, if_busy="raise")
    results: list[SaveHandle] = []
    waiter = threading.Thread(target=lambda: results.append(
        store.save(state_for(2), step=2, blocking=False)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not first.done()  # still held by the gate
    gate.set()
    waiter.join(timeout=60)
    second = results[0].wait(timeout_s=60)
    assert first.wait().step == 1 and second.parent == first.manifest.name
    assert [m.step for m in store.list()] == [1, 2]
    store.close()


def test_background_failure_is_raised_by_wait_and_by_next_save():
    """A write that fails in the background (ENOSPC) is raised by wait(); if nobody
    waits, the next save raises it (or close(), if no save follows); nothing is
    committed and the store keeps working once there is space."""
    store = CheckpointStore(f"{PROTOCOL}://run-{uuid.uuid4().hex}",
                            storage_options=limited_store_options(limit_bytes=30_000))
    store.save({"x": torch.ones(10)}, step=1)
    big = {"x": torch.ones(20_000)}
    handle = store.save(big, step=2, blocking=False)
    with pytest.raises(CheckpointWriteError) as info:
        handle.wait()
    assert info.value.errno == errno.ENOSPC and isinstance(handle.error, CheckpointWriteError)

    unseen = store.save(big, step=3, blocking=False)
    unseen._settle(60)
    with pytest.raises(CheckpointError, match="step 3") as info2:
        store.save({"x": torch.ones(10)}, step=4)
    assert info2.value.__cause__ is unseen.error
    assert [m.step for m in store.list()] == [1]
    store.save({"x": torch.ones(10)}, step=4)
    assert [m.step for m in store.list()] == [1, 4]

    last = store.save(big, step=5, blocking=False)
    with pytest.raises(CheckpointError, match="step 5") as info3:
        store.close()  # the last chance to report it
    assert info3.value.__cause__ is last.error


def test_done_callback_runs_after_commit_and_on_failure(tmp_path):
    """The callback sees a committed manifest (already listed by the store) — the
    point where the trainer may acknowledge stream offsets; added to a finished
    handle it runs at once; on failure it sees the error and no manifest."""
    store = CheckpointStore(tmp_path / "c")
    seen: list[tuple[int | None, list[int], BaseException | None]] = []

    def callback(h: SaveHandle) -> None:
        seen.append((h.manifest.step if h.manifest else None,
                     [m.step for m in store.list()], h.error))

    handle = store.save(state_for(5), step=5, blocking=False, extra={"offsets": {"p": "1-9"}})
    handle.add_done_callback(callback)
    handle.wait()
    store.close()
    assert seen == [(5, [5], None)]
    handle.add_done_callback(callback)
    assert len(seen) == 2

    failing = CheckpointStore(f"{PROTOCOL}://run-{uuid.uuid4().hex}",
                              storage_options=limited_store_options(limit_bytes=10))
    h2 = failing.save({"x": torch.ones(100)}, step=1, blocking=False)
    h2.add_done_callback(callback)
    with pytest.raises(CheckpointWriteError):
        h2.wait()
    assert seen[-1][0] is None and isinstance(seen[-1][2], CheckpointWriteError)


def test_staging_buffer_is_reused_across_saves(tmp_path):
    """Async saves of same-sized states reuse one host buffer (no new allocation);
    a larger state grows it once."""
    store = CheckpointStore(tmp_path / "c", keep_last=2)
    store.save({"w": torch.randn(256, 256)}, step=1, blocking=False).wait()
    ptr = store._pool._buffer.data_ptr()
    capacity = store._pool.capacity
    for step in range(2, 5):
        store.save({"w": torch.randn(256, 256)}, step=step, blocking=False).wait()
        assert store._pool._buffer.data_ptr() == ptr and store._pool.capacity == capacity
    store.save({"w": torch.randn(512, 256)}, step=5, blocking=False).wait()
    assert store._pool.capacity > capacity
    assert [m.step for m in store.list()] == [4, 5]

