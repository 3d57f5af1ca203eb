"""The Hugging Face Trainer and a plain Accelerate loop on several processes (DDP, gloo
on CPU) through the trainguard session: each rank reads its own partitions, the offsets
of every rank are committed with the framework's checkpoint, and the world size may
change between restarts. SIGKILL of one rank, then a resume on 1 process (SIGKILLed), then on 2 (both
SIGKILLed), then on 2 to the end: every record trained exactly once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer
from tests.test_lightning_ddp import kill_across_world_sizes, newest_world_size

N = 480
P = 4
SEEDS = [1, *(pytest.param(s, marks=pytest.mark.chaos) for s in range(2, 22))]


def final_counts(store_url: str, key: str) -> torch.Tensor:
    from checkpoint_store import CheckpointStore

    state: dict[str, dict[str, torch.Tensor]] = {key: {}}
    with CheckpointStore(store_url) as store:
        assert store.load(state) is not None, "no checkpoint was committed"
    return state[key]["counts"]


@pytest.mark.parametrize("seed", SEEDS)
def test_hf_trainer_ddp_survives_rank_kills_and_world_size_changes(
        redis_server: RedisServer, tmp_path: Path, seed: int) -> None:
    """Trainer: world sizes 2, 1, 2, 2: one rank killed (rank 1; under chaos, either, 20
    seeds of kill points), then the one process, then both ranks; the last run
    finishes and its final commit (world 2) holds every record's count: 0 lost, 0
    duplicated."""
    _run(redis_server, tmp_path, seed, "tests._hf_job", "model",
         ["--out", str(tmp_path / "out")])


@pytest.mark.parametrize("seed", SEEDS)
def test_accelerate_loop_ddp_survives_rank_kills_and_world_size_changes(
        redis_server: RedisServer, tmp_path: Path, seed: int) -> None:
    """The Accelerate loop (loader through accelerator.prepare, tg.save_state and
    load_state): the same kills and world sizes, 0 lost, 0 duplicated."""
    _run(redis_server, tmp_path, seed, "tests._accelerate_job", "model_0", [])


def _run(redis_server: RedisServer, tmp_path: Path, seed: int, module: str, key: str,
         extra: list[str]) -> None:
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    rng = random.Random(seed)
    store = f"file://{tmp_path}/ckpt"
    args = ["--redis", redis_server.url, "--dataset", "tok", "--run", "ddp", "--store", store,
            "--n", str(N), "--batch-size", "8", "--ckpt-every", "4", "--sleep-ms", "2", *extra]
    with ledger.zygote(tmp_path / "job.log", module) as z:
        kill_across_world_sizes(z, args, rng, first=1 if seed == 1 else rng.choice([0, 1]))
    assert newest_world_size(store) == 2
    counts = final_counts(store, key)
    assert len(counts) == N
    ledger.assert_each_once(counts)
