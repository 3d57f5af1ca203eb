"""The Lightning integration: killed at random steps (during steps, during a
checkpoint, right after a commit) and resumed with ``ckpt_path="last"``, every record
is trained exactly once; a fresh fit over existing checkpoints is refused, and so is a
checkpoint that trainguard did not write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer

N = 600
P = 4


def _args(url: str, tmp_path: Path, n: int = N) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "pl", "--store", f"file://{tmp_path}/ckpt",
            "--ckpt-dir", str(tmp_path / "lightning"), "--n", str(n), "--batch-size", "8",
            "--ckpt-every", "6", "--sleep-ms", "2"]


def final_counts(store_url: str) -> torch.Tensor:
    from checkpoint_store import CheckpointStore
    from trainguard.integrations.lightning import _Received

    received = _Received()
    store = CheckpointStore(store_url)
    try:
        assert store.load({"lightning": received}) is not None, "no checkpoint was committed"
    finally:
        store.close()
    assert received.loaded is not None
    return received.loaded["state_dict"]["counts"]


def _run(url: str, tmp_path: Path, kills: int, seed: int, n: int = N) -> None:
    spec = cf.create(url, "tok", partitions=P)
    cf.fill(url, spec, n)
    done = ledger.run_until_done(_args(url, tmp_path, n), kills=kills, seed=seed,
                                 log=tmp_path / "job.log", job="tests._lightning_job")
    assert done == kills
    counts = final_counts(f"file://{tmp_path}/ckpt")
    assert len(counts) == n
    ledger.assert_each_once(counts)


def test_lightning_ledger_survives_kills(redis_server: RedisServer, tmp_path: Path) -> None:
    """6 SIGKILLs of a Lightning fit (2 mid-step, 2 during a ModelCheckpoint save, 2 right
    after a commit), each attempt resumed by fit(ckpt_path="last"): every record once."""
    _run(redis_server.url, tmp_path, kills=6, seed=1)


@pytest.mark.chaos
def test_lightning_ledger_survives_40_kills(redis_server: RedisServer, tmp_path: Path) -> None:
    _run(redis_server.url, tmp_path, kills=40, seed=2, n=4000)


def _fit(url: str, tmp_path: Path, ckpt_path: str | None, max_steps: int) -> None:
    from tests._lightning_job import Ledger, trainer_for
    from trainguard.integrations.lightning import TrainguardDataModule

    dm = TrainguardDataModule(url, dataset="tok", run="pl", store=f"file://{tmp_path}/ckpt",
                              batch_size=8, block_ms=200)
    trainer = trainer_for(dm, tmp_path / "lightning", 6, [], max_steps=max_steps)
    try:
        trainer.fit(Ledger(N), datamodule=dm, ckpt_path=ckpt_path)
    finally:
        dm.close()


def test_a_fresh_fit_over_committed_checkpoints_is_refused(redis_server: RedisServer,
                                                           tmp_path: Path) -> None:
    """After a run committed step 12, a fit without ckpt_path (fresh weights, while the
    data would resume) is refused with what to do; with ckpt_path="last" it goes on;
    a torch .ckpt that is not a trainguard marker is refused by the plugin."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    _fit(redis_server.url, tmp_path, None, 12)
    with pytest.raises(RuntimeError, match=r"committed checkpoints \(newest: step 12\).*ckpt_path='last'"):
        _fit(redis_server.url, tmp_path, None, 24)
    _fit(redis_server.url, tmp_path, "last", 18)
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="not a trainguard checkpoint marker"):
        _fit(redis_server.url, tmp_path, str(tmp_path / "plain.ckpt"), 24)


def test_a_fit_forwards_its_loss_to_the_run_page(redis_server: RedisServer,
                                                 tmp_path: Path) -> None:
    """Lightning's own loss reaches the run page without a line of user code: after a
    fit of 10 steps, the run's trainlog (what the dashboard reads) ends with step 10
    and exactly the loss training_step returned at that step; every entry's loss is
    the one of its step."""
    import redis

    from tests._lightning_job import Ledger, trainer_for
    from trainguard.core import trainlog
    from trainguard.integrations.lightning import TrainguardDataModule

    losses: dict[int, float] = {}

    class Recording(Ledger):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            losses[self.global_step + 1] = float(loss)  # the step it completes
            return loss

    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    dm = TrainguardDataModule(redis_server.url, dataset="tok", run="pl",
                              store=f"file://{tmp_path}/ckpt", batch_size=8, block_ms=200)
    trainer = trainer_for(dm, tmp_path / "lightning", 6, [], max_steps=10)
    try:
        trainer.fit(Recording(N), datamodule=dm)
    finally:
        dm.close()
    client = redis.Redis.from_url(redis_server.url)
    try:
        entries = [trainlog.decode(f) for _, f in client.xrange(trainlog.trainlog_key("tok", "pl"))]
    finally:
        client.close()
    assert entries and all(e is not None for e in entries)
    assert entries[-1]["step"] == 10  # type: ignore[index]
    for e in entries:
        assert e is not None
        assert e["values"]["loss"] == losses[e["step"]], (e, losses)
