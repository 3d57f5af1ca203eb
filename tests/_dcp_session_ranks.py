"""One rank of a two-rank gloo job whose ``TrainingSession`` checkpoints through
``DcpCheckpointStore``, for tests/test_checkpoint_dcp_ranks.py.

``save``: restore (nothing there), consume 3 batches, seed this rank's generator
apart from the other's, checkpoint step 3 through DCP, then draw from the generator.
``restore``: a fresh session restores the checkpoint, then draws. Each prints one
JSON line: its partitions' offsets, its own state object as the store holds it, the
draws, and the session record of the manifest.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from checkpoint_store.dcp_store import DcpCheckpointStore
from trainer_client import TrainingSession


def main() -> int:
    mode, redis_url, root = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = DcpCheckpointStore(root)
    session = TrainingSession(redis_url, dataset="tok", run="exp", store=store, rank=rank,
                              world_size=world, block_ms=100)
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 2)}
    step = session.restore(state)
    if mode == "save":
        it = iter(session.batches(DataLoader(session.dataset(batch_size=4), batch_size=None)))
        for _ in range(3):
            next(it)
        torch.manual_seed(100 + rank)  # each rank's random state its own
        manifest = session.checkpoint(state, 3, blocking=True).wait()
        it.close()
        step = 3
    else:
        manifest = store.latest()
        assert manifest is not None
    draws = torch.rand(4).tolist()
    own = store.read_rank_state(manifest, rank)
    mine = sorted(int(p) for p in (own or {}).get("offsets", {}))
    print(json.dumps({
        "step": step, "draws": draws, "object": own,
        "offsets": {str(p): session.offsets[p] for p in mine},
        "record": manifest.extra["trainguard"], "indexed": manifest.ranks is not None,
    }), flush=True)
    session.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
