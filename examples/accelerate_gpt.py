"""The Accelerate recipe: a tiny GPT in a hand-written Accelerate loop on a trainguard
stream, checkpointed through the session, resumed exactly once.

Accelerate prepares the model and optimizer; the trainguard loader is *not* passed
through ``accelerator.prepare`` (its ``DataLoaderShard`` fetches a batch ahead and
cannot shard a stream that trainguard already assigns): the loop reads
``session.batches(loader)``, which records each batch as the loop takes it, and moves
it to ``accelerator.device``. Checkpoints are ``session.checkpoint`` (weights,
optimizer and the consumed offsets in one commit), the restart ``session.restore``::

    python examples/accelerate_gpt.py --dataset story --run-name gpt-acc --die-at-step 25
    python examples/accelerate_gpt.py --dataset story --run-name gpt-acc

Single process (``accelerate launch`` with one process, or plain ``python``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, parse_args, report

from trainer_client import TrainingSession


def main() -> int:
    args = parse_args(__doc__, "gpt-acc")
    url, root = args.url, args.root
    accelerator = Accelerator(cpu=True)
    if accelerator.num_processes > 1:
        raise SystemExit("this recipe is single-process")
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    session = TrainingSession(url, dataset=args.dataset, run=args.run,
                              store=f"file://{root}/trainguard")
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
