"""A checkpoint written by trainguard before per-rank state objects (session record
version 2 in manifest format 2, ``tests/fixtures/ckpt_v2``, made by
``tests/fixtures/make_v2_checkpoint.py`` with the code of that time) still restores:
its weights, its step, and its offsets, so every record of the dataset trains exactly
once across the old run and the resumed one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from tests import _client_fill as cf
from trainer_client import TrainingSession

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_v2"


def test_checkpoint_of_the_v2_format_restores_and_every_record_trains_once(
        redis_server, tmp_path) -> None:
    """Restoring the committed v2 fixture gives step 5 and its exact weights, and the
    resumed run reads exactly the 20 records after its offsets: with the 20 at or
    before them, every one of the 40 records exactly once."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)  # the store may write (pins, gc): never the fixture
    (manifest,) = (root / "manifests").glob("*.json")
    doc = json.loads(manifest.read_bytes())
    assert (doc["version"], doc["extra"]["trainguard"]["version"]) == (2, 2)
    spec = cf.create(redis_server.url, "tok", partitions=4)
    cf.fill(redis_server.url, spec, 40)
    torch.manual_seed(7)
    saved = torch.nn.Linear(4, 2).state_dict()
    state = {"model": torch.nn.Linear(4, 2)}
    s = TrainingSession(redis_server.url, dataset="tok", run="exp", block_ms=100,
                        store=f"file://{root}")
    try:
        assert s.restore(state) == 5
        for k, v in saved.items():
            assert torch.equal(state["model"].state_dict()[k], v)
        after = [int(i) for b in s.batches(DataLoader(s.dataset(batch_size=4), batch_size=None))
                 for i in b.data[:, 0].tolist()]
    finally:
        s.close()
    offsets = {int(p): int(i.split("-")[1])
               for p, i in doc["extra"]["trainguard"]["offsets"].items()}
    before = [i for i in range(40) if i // 4 <= offsets[i % 4]]
    assert len(before) == 20
    assert sorted(before + after) == list(range(40))
