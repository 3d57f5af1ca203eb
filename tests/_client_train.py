"""The ledger training job (run by tests as a subprocess, killed with SIGKILL).

The model holds ``counts``, one float per record of the dataset; every optimizer step
adds 1 to the count of each record in the batch it consumed (summed over ranks, so
the buffer is the same on every rank, like gradients under DDP). A run that trained on
every record exactly once ends with all counts equal to 1.

Prints ``<rank>: READY <step>`` after restoring, ``SAVE <step>`` before each checkpoint call,
``STEP <step>`` after each step, ``COMMITTED <step>`` once its manifest is committed and ``DONE <step>`` at the end (the
parent kills at those moments). Multi-rank: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment (gloo), or, under the trainguard rendezvous, its
``$TRAINGUARD_RDZV_WORKER`` (the group's store in Redis).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from trainer_client import TrainingSession, init_process_group
from trainguard.core.interval import IntervalPolicy


class Ledger(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.register_buffer("counts", torch.zeros(n))


def make_state(n: int) -> tuple[dict[str, object], Ledger, torch.optim.Optimizer]:
    model = Ledger(n)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt}, model, opt


RANK = [0]


def say(line: str) -> None:
    sys.stdout.write(f"{RANK[0]}: {line}\n")
    sys.stdout.flush()


def committed(handle: object, step: int) -> None:
    try:
        handle.wait()  # type: ignore[attr-defined]
    except Exception:
        return
    say(f"COMMITTED {step}")


def node_tiers(args: argparse.Namespace, rank: int) -> Any:
    """This rank as a node: its RAM tier, its partners' copies, its local disk."""
    from pathlib import Path

    from checkpoint_store.node_tiers import NodeTierStore, TierIntervals
    from checkpoint_store.partner import node_root
    from checkpoint_store.ram_tier import RamTierStore

    ram = RamTierStore(node_root(Path(args.store) / f"node{rank}", rank),
                       budget_bytes=args.ram_tier_budget or 64 << 20, keep_last=args.keep_last)
    disk = Path(args.tier_disk) / f"node{rank}" if args.tier_disk else None
    store = NodeTierStore(ram, node=rank, peers=args.tier_peers.split(","), disk_root=disk,
                          intervals=TierIntervals(partner_every=1, disk_every=3))
    store.on_copied = lambda name: say(f"COPIED {name}")
    return store


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ckpt-every", default="10",
                    help="every n-th step, or auto: TrainingSession(checkpoint_every='auto') "
                    "and session.should_checkpoint")
    ap.add_argument("--tier-mtbf-s", default="",
                    help="with --ckpt-every auto: the TierPolicy priors, crash,node,nodes,job")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--trace", default="", help="append each consumed batch's record IDs here")
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--loader", choices=["torch", "stateful", "stateful-in-state"],
                    default="torch", help="torchdata's StatefulDataLoader, passed to "
                    "session.batches (stateful) and also put in the state (stateful-in-state)")
    ap.add_argument("--auto-mtbf-s", type=float, default=0.0,
                    help="checkpoint when session.should_checkpoint says so (this prior MTBF)")
    ap.add_argument("--ram-tier-budget", type=int, default=0,
                    help="the store is a RamTierStore at --store (a /dev/shm path), this budget")
    ap.add_argument("--tier-peers", default="",
                    help="the tier servers' URLs, node by node: the store is a NodeTierStore "
                    "(node = RANK) over a RamTierStore in --store/node<rank>/n<rank>")
    ap.add_argument("--tier-disk", default="", help="with --tier-peers: the local disk tier")
    ap.add_argument("--log-loss", action="store_true",
                    help="session.log(step, loss=<the loss tensor>) each step; prints LOG <step> <loss>")
    args = ap.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    RANK[0] = rank
    if world > 1:
        # trainguard's: under --rdzv-backend=trainguard the group's store is in Redis.
        init_process_group("gloo", rank=rank, world_size=world)
    state, model, opt = make_state(args.n)
    store: Any = args.store
    if args.tier_peers:
        store = node_tiers(args, rank)
    elif args.ram_tier_budget:
        from checkpoint_store.ram_tier import RamTierStore

        store = RamTierStore(args.store, budget_bytes=args.ram_tier_budget,
                             keep_last=args.keep_last)
    auto = args.ckpt_every == "auto"
    every = "auto" if auto else int(args.ckpt_every)
    tier_policy = None
    if args.tier_mtbf_s:
        from trainguard.core.tier_plan import FAILURE_KINDS, TierPolicy

        tier_policy = TierPolicy(prior_mtbf_s=dict(zip(
            FAILURE_KINDS, map(float, args.tier_mtbf_s.split(",")), strict=True)))
    session = TrainingSession(
        args.redis, dataset=args.dataset, run=args.run, store=store,
        rank=rank, world_size=world, keep_last=args.keep_last, deterministic=args.deterministic,
        block_ms=200,
        interval=IntervalPolicy(prior_mtbf_s=args.auto_mtbf_s or 86400.0, min_interval_s=0.05),
        checkpoint_every=every, tier_policy=tier_policy,
    )
    loader: DataLoader[object] | None = None
    if args.loader != "torch":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            session.dataset(batch_size=args.batch_size, drop_last=args.drop_last), batch_size=None,
            num_workers=args.workers, persistent_workers=args.workers > 0,
        )
        if args.loader == "stateful-in-state":
            state["loader"] = loader
    step = session.restore(state)
    if args.tier_peers:
        import json

        say(f"RESTORED_FROM {store.restored_from}")
        # Where the restore found the ranks' state objects (a store without them: none).
        objects = getattr(store, "rank_objects_from", {})
        say(f"OBJECTS_FROM {json.dumps(objects, sort_keys=True)}")
    say(f"READY {step}")
    if loader is None:
        loader = DataLoader(
            session.dataset(batch_size=args.batch_size, drop_last=args.drop_last), batch_size=None,
            num_workers=args.workers, persistent_workers=args.workers > 0,
        )
    trace = open(args.trace, "a") if args.trace else None  # noqa: SIM115
    it = iter(session.batches(loader))
    saved = step
    while True:
        batch = next(it, None)
        local = torch.zeros(args.n)
        # An empty batch: this rank ran out while another still trains (uneven ranks,
        # e.g. after a restore on another world size); it steps along on nothing.
        trains = batch is not None and len(batch) > 0
        if trains:
            idx = batch.data[:, 0].long()
            local.index_add_(0, idx, torch.ones(len(idx)))
        if world > 1:
            more = torch.tensor([0.0 if batch is None else 1.0])
            dist.all_reduce(more)
            if more.item() == 0:
                break
            dist.all_reduce(local)
        elif batch is None:
            break
        if trains:
            x = batch.data.float() / args.n
            loss = model.lin(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.log_loss:
                session.log(step + 1, loss=loss)
                say(f"LOG {step + 1} {float(loss)!r}")
            if trace is not None:
                trace.write(" ".join(str(i) for i in idx.tolist()) + "\n")
                trace.flush()
        model.counts += local
        step += 1
        say(f"STEP {step}")
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        due = session.should_checkpoint(step) if args.auto_mtbf_s or auto else step % every == 0
        if due:
            say(f"SAVE {step}")
            handle = session.checkpoint(state, step)
            if rank == 0:
                handle.add_done_callback(lambda h, s=step: committed(h, s))
            saved = step
    if saved != step:
        say(f"SAVE {step}")
        session.checkpoint(state, step, blocking=True)
    session.close()
    say(f"DONE {step}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
