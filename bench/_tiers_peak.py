"""One peak-memory measurement of ``bench/tiers.py``, in a fresh process of its own.

    python bench/_tiers_peak.py --size-mib N --mode async|blocking --root DIR --peers U0,U1

Builds the bench's state, resets the kernel's peak-RSS mark (``VmHWM``, by writing 5
to ``/proc/self/clear_refs``), then makes one RAM-tier save (``--mode``) of node 0 and
its copy to node 1's tier server (``peers[1]``, a server of the parent process), and
prints one JSON line: the RSS before and after the state was built, the peak RSS
during the save and the copy, and the bytes of node 0's RAM tier on tmpfs. tmpfs
pages belong to the kernel's page cache, not to the process's RSS: the parent adds
them, and the partner's copy, to the node's total.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, required=True)
    ap.add_argument("--mode", choices=["async", "blocking"], required=True)
    ap.add_argument("--root", required=True, help="node 0's tier server root (tmpfs)")
    ap.add_argument("--peers", required=True, help="node 0's and node 1's tier server URLs")
    args = ap.parse_args()
    rss_empty = status_kib("VmRSS")
    state = state_of(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rss_state = status_kib("VmRSS")
    # From here on VmHWM is the peak of the save and the copy alone. Where the kernel
    # refuses the reset, the peak also covers building the state, which allocates the
    # state's bytes and nothing more, so the peak above the state is still the save's.
    try:
        Path("/proc/self/clear_refs").write_text("5\n")
        reset = True
    except OSError:
        reset = False
    ram = RamTierStore(node_root(args.root, 0), budget_bytes=4 * nbytes, keep_last=1)
    tiers = NodeTierStore(ram, node=0, peers=args.peers.split(","))
    tiers.save(state, step=1, blocking=args.mode == "blocking").wait()
    tiers.wait_copies()
    if tiers.copy_failures:
        raise SystemExit(f"the partner copy failed ({tiers.copy_failures} failures); see the log")
    peak = status_kib("VmHWM")
    own = tree_bytes(ram.root)
    tiers.close()
    print(json.dumps({"mode": args.mode, "state_bytes": nbytes, "rss_empty_kib": rss_empty,
                      "rss_state_kib": rss_state, "peak_rss_kib": peak,
                      "own_tier_bytes": own, "hwm_reset": reset}))


if __name__ == "__main__":
    main()
