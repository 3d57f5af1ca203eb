"""A tiered store's local tier fills up after two checkpoints were uploaded.

usage: python -m tests._tier_full_free LOCAL_DIR REMOTE_URL   (LOCAL_DIR: a small tmpfs)
Saves steps 1 and 2, waits for their uploads, fills LOCAL_DIR to ENOSPC with a ballast
file, then saves step 3. Prints one JSON line with what happened; the test asserts on it.
"""

from __future__ import annotations

import json
import sys

import torch

from checkpoint_store import TieredCheckpointStore
from tests._tier_full_job import fill_up


def main() -> None:
    local, remote = sys.argv[1], sys.argv[2]
    store = TieredCheckpointStore(local, remote, keep_last=3, chunk_bytes=64 << 10)
    for step in (1, 2):
        store.save({"w": torch.full((20_000,), float(step))}, step=step)
    assert store.wait_uploads(60)
    fill_up(local)
    store.save({"w": torch.full((20_000,), 3.0)}, step=3)
    out = {"local": [m.step for m in store.local.list()],
           "remote_only_saves": store.remote_only_saves}
    target = {"w": torch.zeros(20_000)}
    out["loaded"] = store.load(target, strict=True).step  # type: ignore[union-attr]
    out["w_ok"] = bool(torch.equal(target["w"], torch.full((20_000,), 3.0)))
    store.wait_uploads(60)
    out["remote"] = sorted(m.step for m in store.remote.list())
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
