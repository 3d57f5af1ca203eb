"""A guarded ledger job for tests/test_heal_node.py, run by real torchrun agents.

Each torchrun node runs one worker (gloo on CPU). The ledger is tests/_guard_train.py's:
``counts`` has one entry per record, an applied step adds 1 to each record of the
batch; the gradients are summed over ranks (as DDP would), so every rank holds the
same counts and the checkpoint (saved from rank 0) has every rank's records.

The node whose environment has ``HEAL_BAD=1`` (or the rank ``--bad-rank``) has a fake NVML whose GPU reports an
uncorrected ECC error (CRITICAL) right after step ``--critical-at`` of its first
worker. Prints ``START <node> <rank> <world> <restart count>`` on start, ``STEP
<step>`` after each applied step and ``DONE <step>`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests._fake_nvml import FakeGpu, FakeNvml
from tests._guard_train import make_state, session
from trainer_client.dataset import Batch
from trainer_client.guard import GuardedTraining
from trainer_client.health import HealthMonitor, HealthProbe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--critical-at", type=int, required=True)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--bad-rank", type=int, default=-1,
                    help="this rank's GPU fails (without torchrun: no node to pick by env)")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("TRAINGUARD_NODE_ID") or f"node{rank}"
    os.environ["TRAINGUARD_NODE_ID"] = node
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    bad = (os.environ.get("HEAL_BAD") == "1" or rank == args.bad_rank) and restart == 0
    print(f"START {node} {rank} {world} {restart} {time.time():.1f}", flush=True)

    gpu = FakeGpu()
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])), interval_s=3600.0)
    monitor.probe_now()
    torch.manual_seed(0)  # every rank starts from the same weights, as under DDP
    state, model, opt = make_state(args.records)
    sess = session(args.redis, args.store, rank=rank, world_size=world)
    guarded = GuardedTraining(sess, state, optimizer=opt, monitor=monitor)

    def train_step(batch: Batch) -> torch.Tensor:
        if len(batch):
            idx = batch.data[:, 0].long()
            (-model.counts[idx].sum() + 0 * model.lin(batch.data.float()).sum()).backward()
        else:  # out of data while a peer is not: a zero step, the all-reduce still matches
            (0 * model.counts.sum() + 0 * sum(p.sum() for p in model.lin.parameters())).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        return torch.tensor(1.0)

    def after_step() -> None:
        print(f"STEP {guarded.step} {time.time():.2f}", flush=True)
        if bad and guarded.step == args.critical_at:
            gpu.ecc_uncorrected = 1  # the GPU fails; the monitor's next probe sees it
            monitor.probe_now()

    opt.register_step_post_hook(lambda *_: after_step())
    guarded.restore()
    try:
        loader = DataLoader(sess.dataset(batch_size=8), batch_size=None,
                            num_workers=args.workers)
        step = guarded.run(loader, train_step, checkpoint_every=1000)
    finally:
        sess.close()
    print(f"DONE {step} {time.time():.2f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:  # GuardedTraining's exit: 75 on the bad node, 76 on the other
        code = int(exc.code or 0)
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is committed and closed by now; skip the interpreter's teardown of
    # torch (seconds on a loaded machine): the agent only reads the exit code.
    os._exit(code)
