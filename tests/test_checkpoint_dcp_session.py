"""A TrainingSession checkpointing through torch.distributed.checkpoint: the
DcpCheckpointStore port runs dcp.save/async_save/load with trainguard's storage
backend, and the session's offsets are still committed with the checkpoint (in the
rank's state object the manifest indexes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from checkpoint_store import CheckpointError, CheckpointStore
from checkpoint_store.dcp_store import DcpCheckpointStore
from tests import _client_fill as cf
from trainer_client import TrainingSession

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "epoch": seed}


def _session(url: str, root: str) -> TrainingSession:
    return TrainingSession(url, dataset="tok", run="exp", block_ms=100,
                           store=DcpCheckpointStore(root))


@pytest.mark.parametrize("blocking", [True, False], ids=["save", "async_save"])
def test_session_checkpoints_through_dcp_and_resumes_exactly(redis_server, tmp_path,
                                                             blocking):
    """5 batches consumed, checkpointed through DCP (save or async_save), 3 more
    consumed, then a crash: the next session restores the DCP checkpoint (weights
    and a plain value bit for bit, its step) and re-reads exactly the records after
    the manifest's offsets, so every record is trained once."""
    spec = cf.create(redis_server.url, "tok", partitions=3)
    cf.fill(redis_server.url, spec, 120)
    root = f"file://{tmp_path}/ckpt"
    a = _session(redis_server.url, root)
    state = _state(7)
    assert a.restore(state) == 0
    it = iter(a.batches(DataLoader(a.dataset(batch_size=8), batch_size=None)))
    first = [next(it) for _ in range(5)]
    manifest = a.checkpoint(state, 5, blocking=blocking).wait()
    # The offsets are committed in the rank's own state object, indexed by the manifest.
    assert "offsets" not in manifest.extra["trainguard"]
    assert a.store.read_rank_state(manifest, 0)["offsets"] == {  # type: ignore[attr-defined]
        str(p): i for p, i in a.offsets.items()}
    [next(it) for _ in range(3)]  # consumed, never checkpointed: lost with the crash

    b = _session(redis_server.url, root)
    restored = _state(0)
    assert b.restore(restored) == 5
    assert restored["epoch"] == 7
    assert torch.equal(restored["model"].weight, state["model"].weight)  # type: ignore[union-attr]
    rest = list(b.batches(DataLoader(b.dataset(batch_size=8), batch_size=None)))
    seen = [int(i) for batch in first + rest for i in batch.data[:, 0].tolist()]
    assert sorted(seen) == list(range(120))
    b.close()
    assert [m.step for m in CheckpointStore(root).list()] == [5]


def test_a_value_dcp_cannot_store_without_pickle_is_refused(tmp_path):
    """A non-tensor item msgpack cannot hold (an arbitrary object) is refused with a
    CheckpointError naming it, not pickled, and nothing is committed."""
    store = DcpCheckpointStore(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"'odd'.*not supported"):
        store.save({"w": torch.ones(2), "odd": object()}, step=1)
    assert store.list() == []
    store.close()


def test_dcp_store_refuses_an_unknown_if_busy_like_the_store(tmp_path):
    """``if_busy`` outside IfBusy is a ValueError naming the accepted values from the
    DCP store too (it used to behave as "wait"), and nothing is committed; the same
    call with "raise" and no save in flight commits."""
    store = DcpCheckpointStore(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="if_busy must be 'wait' or 'raise', got 'skip'"):
        store.save({"w": torch.ones(2)}, step=1, if_busy="skip")  # type: ignore[arg-type]
    assert store.list() == []
    store.save({"w": torch.ones(2)}, step=1, if_busy="raise").wait()
    assert [m.step for m in store.list()] == [1]
    store.close()
