"""Full-disk scenario, run inside a private mount namespace on a 1 MiB tmpfs.

usage: python tests/_ckpt_enospc.py DIR   (DIR is the tmpfs mount point)
Prints one JSON line with what happened; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from checkpoint_store import CheckpointStore, CheckpointWriteError


def main() -> None:
    root = sys.argv[1]
    store = CheckpointStore(root, chunk_bytes=64 << 10)
    small = {"w": torch.arange(10_000, dtype=torch.float32), "step": 1}
    store.save(small, step=1)
    out: dict[str, object] = {}
    try:
        store.save({"w": torch.ones(400_000), "step": 2}, step=2)  # 1.6 MB > 1 MiB
        out["error"] = None
    except CheckpointWriteError as e:
        out["error"] = {"errno": e.errno, "message": str(e)}
    target = {"w": torch.zeros(10_000), "step": 0}
    manifest = store.load(target, strict=True)
    out["loaded"] = manifest.step if manifest else None
    out["w_ok"] = bool(torch.equal(target["w"], small["w"]))
    out["steps"] = [m.step for m in store.list()]
    out["verify"] = store.verify(1).step
    out["gc"] = store.gc().removed_data
    out["data_dirs"] = len(os.listdir(os.path.join(root, "data")))
    store.save({"w": torch.arange(10_000, dtype=torch.float32) * 3, "step": 3}, step=3)
    out["after"] = [m.step for m in store.list()]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
