"""The Accelerate recipe: a tiny GPT in a hand-written Accelerate loop on a trainguard
stream, checkpointed through the session, resumed exactly once.

Accelerate prepares the model and optimizer; the trainguard loader is *not* passed
through ``accelerator.prepare`` (its ``DataLoaderShard`` fetches a batch ahead and
cannot shard a stream that trainguard already assigns): the loop reads
``session.batches(loader)``, which records each batch as the loop takes it, and moves
it to ``accelerator.device``. Checkpoints are ``session.checkpoint`` (weights,
optimizer and the consumed offsets in one commit), the restart ``session.restore``::

    python examples/accelerate_gpt.py --dataset story --run gpt-acc --die-at-step 25
    python examples/accelerate_gpt.py --dataset story --run gpt-acc

Single process (``accelerate launch`` with one process, or plain ``python``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, report

from trainer_client import TrainingSession
from trainguard.core import settings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--dataset", default="story")
    ap.add_argument("--run", default="gpt-acc")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "trainguard-examples"),
                    help="checkpoints go here (default: $TMPDIR/trainguard-examples)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--die-at-step", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a tiny model: more threads cost more than they give
    url = settings.redis_url(args.redis_url)
    accelerator = Accelerator(cpu=True)
    if accelerator.num_processes > 1:
        raise SystemExit("this recipe is single-process")
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    session = TrainingSession(url, dataset=args.dataset, run=args.run,
                              store=f"file://{Path(args.dir) / args.run}/trainguard")
    state = {"model": model, "optim": opt}
    step = session.restore(state)  # weights, optimizer and offsets of one commit
    resumed = step
    model, opt = accelerator.prepare(model, opt)
    loader = DataLoader(session.dataset(args.batch_size), batch_size=None)
    for batch in session.batches(loader):
        loss = accelerator.unwrap_model(model).loss(batch.data.long().to(accelerator.device))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        if step == args.die_at_step:
            print(f"SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.ckpt_every == 0:
            session.checkpoint(state, step)
    session.checkpoint(state, step, blocking=True)
    print(f"resumed from step {resumed}, ended at step {step}", flush=True)
    ok = report(accelerator.unwrap_model(model), url, args.dataset)
    session.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
