"""The Hugging Face Trainer integration: killed at random steps (during steps, during
a checkpoint, right after a commit) and resumed through ``resume_from_checkpoint``,
every record is trained exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer

N = 600
P = 4


def final_counts(store_url: str) -> torch.Tensor:
    from checkpoint_store import CheckpointStore

    state: dict[str, dict[str, torch.Tensor]] = {"model": {}}
    store = CheckpointStore(store_url)
    try:
        assert store.load(state) is not None, "no checkpoint was committed"
    finally:
        store.close()
    return state["model"]["counts"]


def _run(url: str, tmp_path: Path, kills: int, seed: int, n: int = N) -> None:
    spec = cf.create(url, "tok", partitions=P)
    cf.fill(url, spec, n)
    args = ["--redis", url, "--dataset", "tok", "--run", "hf", "--store", f"file://{tmp_path}/ckpt",
            "--out", str(tmp_path / "out"), "--n", str(n), "--sleep-ms", "2"]
    done = ledger.run_until_done(args, kills=kills, seed=seed, log=tmp_path / "job.log",
                                 job="tests._hf_job")
    assert done == kills
    counts = final_counts(f"file://{tmp_path}/ckpt")
    assert len(counts) == n
    ledger.assert_each_once(counts)


def test_hf_trainer_ledger_survives_kills(redis_server: RedisServer, tmp_path: Path) -> None:
    """6 SIGKILLs of a Trainer run (2 mid-step, 2 during a checkpoint, 2 right after a
    commit), each resumed through resume_from_checkpoint: every record once."""
    _run(redis_server.url, tmp_path, kills=6, seed=1)


@pytest.mark.chaos
def test_hf_trainer_ledger_survives_40_kills(redis_server: RedisServer, tmp_path: Path) -> None:
    _run(redis_server.url, tmp_path, kills=40, seed=2, n=4000)


def test_settings_that_would_lose_records_are_refused(redis_server: RedisServer,
                                                      tmp_path: Path) -> None:
    """The Trainer's data skip on resume (it would skip stream batches), reading
    workers of its own, and a batch size other than the stream's: the callback refuses
    to train, naming each setting to change."""
    from transformers import Trainer, TrainingArguments

    from tests._hf_job import Ledger
    from trainguard.integrations.hf import TrainguardHF

    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, 16)
    tg = TrainguardHF(redis_server.url, dataset="tok", run="hf", batch_size=8,
                      store=f"file://{tmp_path}/ckpt")
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                             dataloader_num_workers=1, report_to=[], use_cpu=True)
    trainer = Trainer(model=Ledger(16), args=args, train_dataset=tg.train_dataset,
                      callbacks=[tg.callback])
    try:
        with pytest.raises(ValueError, match=r"ignore_data_skip=True .*; dataloader_num_workers=0"
                                             r".*; per_device_train_batch_size=8"):
            trainer.train()
        assert tg.session.checkpoints() == []
    finally:
        tg.close()


def test_the_trainer_forwards_its_logs_to_the_run_page(redis_server: RedisServer,
                                                      tmp_path: Path) -> None:
    """The HF Trainer's own logs reach the run page without a line of user code: with
    logging every step over 6 steps, the run's trainlog ends with step 6 holding
    exactly the loss the Trainer logged at step 6 (and its end-of-training summary's
    train_loss, logged at the same step), and every entry's loss is its step's."""
    import redis
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tests._hf_job import Ledger
    from trainguard.core import trainlog
    from trainguard.integrations.hf import TrainguardHF

    logged: dict[int, dict[str, float]] = {}

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            logged.setdefault(state.global_step, {}).update(logs or {})

    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, 48)
    tg = TrainguardHF(redis_server.url, dataset="tok", run="hf", batch_size=8,
                      store=f"file://{tmp_path}/ckpt", block_ms=200)
    targs = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=6,
                              save_steps=3, ignore_data_skip=True, report_to=[], use_cpu=True,
                              logging_steps=1, disable_tqdm=True)
    trainer = tg.attach(Trainer(model=Ledger(48), args=targs, train_dataset=tg.train_dataset,
                                callbacks=[tg.callback, Record()]))
    try:
        trainer.train()
    finally:
        tg.close()
    client = redis.Redis.from_url(redis_server.url)
    try:
        entries = [trainlog.decode(f) for _, f in client.xrange(trainlog.trainlog_key("tok", "hf"))]
    finally:
        client.close()
    assert entries and entries[-1] is not None and entries[-1]["step"] == 6
    assert entries[-1]["values"]["loss"] == logged[6]["loss"]
    assert entries[-1]["values"]["train_loss"] == logged[6]["train_loss"]
    for e in entries:
        assert e is not None and e["values"]["loss"] == logged[e["step"]]["loss"], (e, logged)
