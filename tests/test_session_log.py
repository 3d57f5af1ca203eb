"""``session.log``: what the loop reports reaches Redis for the run page, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from torch.utils.data import DataLoader

from tests import _client_fill as cf
from tests.servers import RedisServer
from trainer_client import TrainingSession
from trainguard.core import trainlog

N, P, BATCH = 96, 4, 8


def _entries(url: str) -> list[dict]:
    client = redis.Redis.from_url(url)
    try:
        rows = client.xrange(trainlog.trainlog_key("tok", "exp"))
    finally:
        client.close()
    return [d for d in (trainlog.decode(f) for _, f in rows) if d is not None]


def test_the_newest_loss_of_a_run_is_in_redis_with_its_step_and_the_steps_left(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A loop of 12 steps (96 records, batches of 8) logs its loss tensor at every step
    with the session's own step count: the trainlog ends with step 12, that step's loss
    exactly, and 0 steps left; every entry is a step's own loss, with the steps left
    of a 12-step epoch (12 - step); a value that is no number is refused with what to
    pass, and writes nothing."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    model = torch.nn.Linear(8, 1)
    session = TrainingSession(redis_server.url, dataset="tok", run="exp",
                              store=f"file://{tmp_path}/ckpt", block_ms=100)
    losses: dict[int, float] = {}
    try:
        step = session.restore({"model": model})
        loader = DataLoader(session.dataset(batch_size=BATCH), batch_size=None)
        for batch in session.batches(loader):
            loss = model(batch.data.float()).pow(2).mean()
            step += 1
            losses[step] = float(loss)
            session.log(loss=loss)
        with pytest.raises(trainlog.TrainLogError, match=r"expects a number or a one-element "
                                                         r"tensor, got str.*loss\.item\(\)"):
            session.log(loss="low")
        with pytest.raises(trainlog.TrainLogError, match="of 8 elements"):
            session.log(loss=torch.zeros(8))
        session.checkpoint({"model": model}, step, blocking=True)
    finally:
        session.close()
    entries = _entries(redis_server.url)
    assert entries[-1]["step"] == 12 and entries[-1]["steps_left"] == 0
    assert entries[-1]["values"] == {"loss": losses[12]}
    for e in entries:
        assert e["values"] == {"loss": losses[e["step"]]}
        assert e["steps_left"] == N // BATCH - e["step"]
    assert len({e["step"] for e in entries}) == len(entries)
