"""One peak-memory measurement of ``bench/tiers.py``, in a fresh process of its own.

    python bench/_tiers_peak.py --size-mib N --mode async|blocking --root DIR --peers U0,U1
                                --partner-root DIR [--saves 3] [--overwrite-oldest]

Builds the bench's state, then makes ``--saves`` RAM-tier saves (``--mode``) of node 0,
each followed by its copy to node 1's tier server (``peers[1]``, a server of the parent
process, which keeps the copies under ``--partner-root``): the steady state, where
each save replaces the one before, not only the first. A thread samples every 2 ms
the process's private memory (``RssAnon``: not the tier's tmpfs pages that the store
keeps mapped, which are the tier's bytes, counted once, below, nor the file pages of
the libraries a first save runs, which are shared, reclaimable page cache) and the bytes
of node 0's RAM tier plus the partner's copy on tmpfs; it prints one JSON line with
the private memory before and after the state was built, its peak, and the peak of
the two tiers' bytes together (and ``VmHWM``, which counts mapped tmpfs pages too).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from checkpoint_store.node_tiers import NodeTierStore
from checkpoint_store.partner import node_root
from checkpoint_store.ram_tier import RamTierStore, tree_bytes


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {key}")


def state_of(size_mib: int) -> dict[str, torch.Tensor]:
    """The bench's state: 8 float32 tensors of ``size_mib`` MiB together."""
    g = torch.Generator().manual_seed(0)
    per = size_mib * 2**20 // 4 // 8
    return {f"layer{i}": torch.randn(per, generator=g) for i in range(8)}


def private_kib() -> int:
    """The process's own memory: its resident anonymous pages (heap, stacks, buffers).
    ``VmRSS`` less ``RssShmem`` counted ``RssFile`` too: 2-4 MiB of library code and
    data paged in by the first saves (crc32c, torch's kernels, the HTTP client), pages
    of files that every process using them shares and the kernel may drop."""
    return status_kib("RssAnon")


class Sampler:
    """The peaks of :func:`private_kib` and of the tiers' tmpfs bytes while it runs."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self.private_kib = private_kib()
        self.tier_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        self.private_kib = max(self.private_kib, private_kib())
        self.tier_bytes = max(self.tier_bytes, sum(tree_bytes(r) for r in self.roots))

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, required=True)
    ap.add_argument("--mode", choices=["async", "blocking"], required=True)
    ap.add_argument("--root", required=True, help="node 0's tier server root (tmpfs)")
    ap.add_argument("--peers", required=True, help="node 0's and node 1's tier server URLs")
    ap.add_argument("--partner-root", required=True, help="where node 1 keeps node 0's copies")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--overwrite-oldest", action="store_true")
    args = ap.parse_args()
    private_empty = private_kib()
    state = state_of(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    private_state = private_kib()
    ram = RamTierStore(node_root(args.root, 0), budget_bytes=4 * nbytes, keep_last=1,
                       overwrite_oldest=args.overwrite_oldest)
    tiers = NodeTierStore(ram, node=0, peers=args.peers.split(","), hold_until_copied=True)
    sampler = Sampler([ram.root, Path(args.partner_root)])
    for step in range(1, args.saves + 1):
        tiers.save(state, step=step, blocking=args.mode == "blocking").wait()
        tiers.wait_copies()
        for v in state.values():
            v.add_(1.0)
    sampler.stop()
    if tiers.copy_failures:
        raise SystemExit(f"the partner copy failed ({tiers.copy_failures} failures); see the log")
    hwm = status_kib("VmHWM")
    own = tree_bytes(ram.root)
    tiers.close()
    print(json.dumps({"mode": args.mode, "saves": args.saves,
                      "overwrite_oldest": args.overwrite_oldest, "state_bytes": nbytes,
                      "private_empty_kib": private_empty, "private_state_kib": private_state,
                      "peak_private_kib": sampler.private_kib, "vm_hwm_kib": hwm,
                      "peak_tiers_bytes": sampler.tier_bytes, "own_tier_bytes": own}))


if __name__ == "__main__":
    main()
