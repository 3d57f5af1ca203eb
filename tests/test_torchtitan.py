"""torchtitan with trainguard as its data loader and its checkpoint storage (2
processes, gloo on CPU): torchtitan's own CheckpointManager, OptimizersContainer and
LRSchedulersContainer, with TrainguardDataLoader as the manager's dataloader and the
saves committed through the session (DCP with trainguard's StorageWriter/Reader).

torchtitan is not in the dev extra (its pins would replace the datasets this project
tests with): `make setup` installs it with --no-deps (the Makefile's TORCHTITAN line),
and these tests are skipped where it is missing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer
from tests.test_lightning_ddp import kill_across_world_sizes, newest_world_size

pytest.importorskip("torchtitan.components.checkpoint")

N = 480
P = 4


def _args(url: str, tmp_path: Path, workers: int = 0) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "titan", "--store",
            f"file://{tmp_path}/ckpt", "--n", str(N), "--batch-size", "8",
            "--ckpt-every", "4", "--sleep-ms", "2", "--workers", str(workers)]


def final_counts(store_url: str) -> torch.Tensor:
    """The ledger of the newest commit, read back through DCP and trainguard's reader."""
    from checkpoint_store.dcp_store import DcpCheckpointStore

    state = {"counts": torch.zeros(N)}
    store = DcpCheckpointStore(store_url)
    try:
        assert store.load(state, keys=["counts"]) is not None, "no checkpoint was committed"
    finally:
        store.close()
    return state["counts"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("seed", [1, *(pytest.param(s, marks=pytest.mark.chaos)
                                      for s in range(2, 12))])
def test_torchtitan_survives_rank_kills_and_dp_degree_changes(
        redis_server: RedisServer, tmp_path: Path, seed: int, workers: int) -> None:
    """torchtitan's CheckpointManager with the trainguard loader: data-parallel degree
    2 (one rank SIGKILLed), 1 (killed), 2 (both killed), then 2 to the end; the final
    checkpoint's per-record ledger: 0 lost, 0 duplicated (torchtitan's own loader
    refuses the change of degree)."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    rng = random.Random(seed)
    with ledger.zygote(tmp_path / "job.log", "tests._titan_job") as z:
        kill_across_world_sizes(z, _args(redis_server.url, tmp_path, workers), rng,
                                first=1 if seed == 1 else rng.choice([0, 1]))
    assert newest_world_size(f"file://{tmp_path}/ckpt") == 2
    counts = final_counts(f"file://{tmp_path}/ckpt")
    ledger.assert_each_once(counts)
