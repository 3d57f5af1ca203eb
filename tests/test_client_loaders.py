"""No silent loss from any loader.

- torchdata's ``StatefulDataLoader`` in the checkpointed state (README: "anything with
  state_dict()") would be restored with the checkpoint and skip the batches it had
  yielded, past the session's offsets: the session refuses it before anything is
  read or committed, in greedy and deterministic mode, saying what to pass instead;
  the same loader passed to ``session.batches`` only survives SIGKILLs with every
  record trained exactly once (the ledger).
- A loader that skips a batch of a worker makes deterministic mode's merge raise
  :class:`BatchGapError` naming the missing batch (it used to wait for it and drop
  every later batch at the end of the pass, with no error), and nothing after the gap
  is recorded as consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer
from trainer_client import Batch, BatchGapError, LoaderPositionError, TrainingSession

N = 240
P = 4
MODES = {"greedy": [], "deterministic": ["--deterministic"]}


def _args(url: str, store: str, *extra: str) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "exp", "--store", store,
            "--n", str(N), "--batch-size", "8", "--ckpt-every", "4", "--sleep-ms", "2",
            "--workers", "2", *extra]


@pytest.fixture
def filled(redis_server: RedisServer) -> str:
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    return redis_server.url


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_stateful_loader_in_the_state_is_refused_and_outside_it_trains_each_once(
        filled: str, tmp_path: Path, mode: str) -> None:
    """With a StatefulDataLoader in the state the job is refused at its restore, before
    reading or committing anything, with what to do; the same loader outside the
    state, SIGKILLed twice: 0 lost, 0 duplicated."""
    store = f"file://{tmp_path}/ckpt"
    with ledger.zygote(tmp_path / "refused.log") as z:
        job = z.spawn(_args(filled, store, *MODES[mode], "--loader", "stateful-in-state"), 1)
        while not job.exits:
            job.next_line(0.5)
    assert job.exits[0] == 1 and not any(s.startswith("0: STEP") for s in job.seen), job.seen
    log = (tmp_path / "refused.log").read_text()
    assert "LoaderPositionError: state['loader'] is a StatefulDataLoader" in log, log[-3000:]
    assert "keep the loader out of the state and pass it to session.batches()" in log
    assert not (tmp_path / "ckpt" / "manifests").exists() or not list(
        (tmp_path / "ckpt" / "manifests").iterdir()), "the refused job committed a checkpoint"

    done = ledger.run_until_done(_args(filled, store, *MODES[mode], "--loader", "stateful"),
                                 kills=2, seed=7, log=tmp_path / "job.log")
    assert done == 2
    counts, _ = ledger.final_counts(store, N)
    ledger.assert_each_once(counts)


class _SkipsOne:
    """A loader that loses one batch of its own, as a loader resuming a position of its
    own does: the DataLoader's batches, but the third one is never handed on."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.num_workers = loader.num_workers
        self.persistent_workers = False
        self.handed: list[Batch] = []

    def __iter__(self) -> Iterator[Batch]:
        for i, batch in enumerate(self.loader):
            if i != 2:
                self.handed.append(batch)
                yield batch


def test_a_skipped_batch_raises_in_deterministic_mode_naming_it(filled: str,
                                                                tmp_path: Path) -> None:
    """A worker's batch that never comes raises BatchGapError at the next batch of that
    worker, naming the batch expected; the consumed offsets are exactly those of the
    batches the loop got."""
    with TrainingSession(filled, dataset="tok", run="gap", store=f"file://{tmp_path}/ckpt",
                         block_ms=200) as session:
        session.restore({})
        loader = _SkipsOne(DataLoader(session.dataset(8), batch_size=None, num_workers=2))
        got: list[Batch] = []
        with pytest.raises(BatchGapError, match=r"expected batch #1 of loader worker 0 .*got #2"):
            for batch in session.batches(loader):
                got.append(batch)
        consumed: dict[int, str] = {}
        for batch in got:
            consumed.update(batch.offsets)
        assert got and session.offsets == {**{p: "0-0" for p in range(P)}, **consumed}


def test_a_stateful_loader_given_a_position_is_refused_at_its_pass(filled: str,
                                                                   tmp_path: Path) -> None:
    """A StatefulDataLoader handed a position with load_state_dict (outside the state)
    is refused when session.batches starts its pass, before it reads."""
    with TrainingSession(filled, dataset="tok", run="pos", store=f"file://{tmp_path}/ckpt",
                         block_ms=200, deterministic=False) as session:
        session.restore({})
        loader = StatefulDataLoader(session.dataset(8), batch_size=None)
        first = iter(session.batches(loader))
        next(first)
        saved = loader.state_dict()
        first.close()  # type: ignore[attr-defined]
        loader.load_state_dict(saved)
        with pytest.raises(LoaderPositionError, match="given a position with load_state_dict"):
            next(iter(session.batches(loader)))
