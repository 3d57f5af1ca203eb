"""Checkpoint tiers against local disk: save to the RAM tier vs save to disk, and
restore from RAM, from a partner's RAM (over its tier server) and from disk, for the
same state, in interleaved rounds.

    python bench/tiers.py [--size-mib 256] [--rounds 6] [--dir /path/on/disk]

Each group runs in rounds (a balanced order, the first round discarded as warm-up;
see ``rounds.py``); a ratio is taken within each round, then the median over rounds
is printed with its range. The disk store fsyncs every file, as in production; the
page cache is left warm for the disk restore (the disk tier's best case). The
partner runs as a tier server in this process (one machine: the transfer is
loopback TCP, so this measures the protocol and the copies, not a network).
Not measured yet (issue #28): remote (moto S3) restores, the loop's stall of an
async RAM-tier save, peak host memory, lost work at the advisor's intervals.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rounds as rd

from checkpoint_store import CheckpointStore
from checkpoint_store.node_tiers import NodeTierStore
from checkpoint_store.partner import TierServer, node_root
from checkpoint_store.ram_tier import RamTierStore


def state_of(size_mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = size_mib * 2**20 // 4 // 8
    return {f"layer{i}": torch.randn(per, generator=g) for i in range(8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where the disk tier goes (default: tmp)")
    args = ap.parse_args()
    state = state_of(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    shm = Path("/dev/shm") / f"trainguard-bench-{uuid.uuid4().hex}"
    disk_dir = Path(tempfile.mkdtemp(prefix="tg-tiers-", dir=rd.ensure_dir(args.dir)))
    budget = 4 * nbytes
    servers = [TierServer(shm / f"node{n}", node=n, budget_bytes=budget).start()
               for n in range(2)]
    try:
        ram = RamTierStore(node_root(shm / "node0", 0), budget_bytes=budget, keep_last=1)
        tiers = NodeTierStore(ram, node=0, peers=[s.url for s in servers])
        disk = CheckpointStore(disk_dir, keep_last=1)
        steps = iter(range(1, 10**6))

        def ram_save() -> int:
            ram.save(state, step=next(steps)).wait()
            return nbytes

        def disk_save() -> int:
            disk.save(state, step=next(steps)).wait()
            return nbytes

        saves = rd.run_rounds({"RAM tier save": ram_save, "disk save": disk_save},
                              rounds=args.rounds)
        # One checkpoint of the same state in every tier, copied to the partner.
        step = next(steps)
        tiers.save(state, step=step).wait()
        tiers.wait_copies()
        disk.save(state, step=step).wait()
        target = {k: torch.empty_like(v) for k, v in state.items()}

        def drop_own(name: str) -> None:
            if name == "partner restore":
                ram.delete(step)  # node 0's RAM is gone: the fetch brings the copy back

        def from_ram() -> int:
            ram.load(target, step=step)
            return nbytes

        def from_partner() -> int:
            tiers.load(target, step=step)
            assert tiers.restored_from == "partner:n1", tiers.restored_from
            return nbytes

        def from_disk() -> int:
            disk.load(target, step=step)
            return nbytes

        loads = rd.run_rounds({"RAM restore": from_ram, "partner restore": from_partner,
                               "disk restore": from_disk}, rounds=args.rounds,
                              before=drop_own)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        print(f"state {nbytes / 2**20:.0f} MiB, {args.rounds} rounds + 1 warm-up per group")
        for title, r in (("save", saves), ("restore", loads)):
            print(f"\n[{title}]")
            print(rd.table(r))
        print()
        rd.print_headlines([
            rd.speed_ratio(saves, "RAM tier save", "disk save",
                           name="RAM tier save speed / disk save (fsync'd)"),
            rd.speed_ratio(loads, "RAM restore", "disk restore",
                           name="RAM restore speed / disk restore (warm cache)"),
            rd.speed_ratio(loads, "partner restore", "disk restore",
                           name="partner restore speed / disk restore (warm cache)"),
        ])
        tiers.close()
        disk.close()
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
