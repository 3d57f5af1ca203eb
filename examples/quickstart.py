"""The training loop of README's quickstart (docs/guides/training-loop.md shows it
whole): copy it and make it yours."""
import logging
import os
import signal

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from trainer_client import TrainingSession

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the session says what it restored

REDIS = os.environ.get("TRAINGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
STORE = os.environ.get("CKPT_URL", "file:///tmp/ckpt/exp42")   # any fsspec URL: s3://...
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    dist.init_process_group("gloo")      # before the session: ranks commit together

session = TrainingSession(REDIS, dataset="tokens", run="exp42", store=STORE,
                          rank=rank, world_size=world)
data = session.dataset(batch_size=32)    # batches of 32 windows, never across epochs
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Dropout(0.1),
                            torch.nn.Linear(64, 256))
net = DistributedDataParallel(model) if world > 1 else model
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
plan = session.progress()               # steps an epoch takes, known before the first
steps = plan.steps_per_epoch * (plan.epochs or 1)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
state = {"model": model, "optim": opt, "sched": sched}   # anything with state_dict()
step = start = session.restore(state)   # newest checkpoint: weights, offsets, random states

loader = DataLoader(data, batch_size=None, num_workers=2)
for batch in session.batches(loader):    # only what the loop consumed is committed
    # batch.data: a [32, 65] tensor of tokens; len(batch) == 0 when this rank is out
    # of data while another still trains: it steps along, so the ranks stay in step.
    x = batch.data.long() if len(batch) else torch.zeros(0, 65, dtype=torch.long)  # any int dtype
    logits, targets = net(x[:, :-1]), x[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    opt.zero_grad()
    (loss / max(1, targets.numel())).backward()
    opt.step()
    sched.step()
    step += 1
    if step % 20 == 0:
        session.checkpoint(state, step)  # async; the consumed offsets go in with it
        p = session.progress()
        print(f"rank {rank} step {step} epoch {p.epoch}: {p.remaining} records left")
    if os.environ.get("KILL_AT") == str(step):  # a crash, for the quickstart
        os.kill(os.getpid(), signal.SIGKILL)
if step > start:
    session.checkpoint(state, step, blocking=True)   # the steps since the last checkpoint
elif rank == 0:
    print(f"run exp42 is finished (step {step}): nothing left to train, nothing written")
session.close()
