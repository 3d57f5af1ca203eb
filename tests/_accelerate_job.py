"""The ledger job in a plain Accelerate loop (run by tests as a forked process, one
per rank). The model is ``tests._hf_job.Ledger`` (one count per record, every rank's
records added on every rank); the loader goes through ``accelerator.prepare``,
checkpoints are ``tg.save_state(step)`` every ``--ckpt-every`` steps and at the end,
and every attempt resumes with ``tg.load_state()``.

Prints ``<rank>: READY``, ``<rank>: STEP <step>``, ``<rank>: SAVE <step>`` before a
checkpoint, ``<rank>: COMMITTED <step>`` after it, ``<rank>: DONE <step>``.
"""

from __future__ import annotations

import sys
import time

import torch
from accelerate import Accelerator

from tests._hf_job import Ledger, job_args, say
from trainguard.integrations.hf_accelerate import TrainguardAccelerate


def warm_up() -> None:
    from tests._hf_job import warm_up as hf_warm_up

    hf_warm_up()


def main(argv: list[str] | None = None) -> int:
    args = job_args(argv, "--redis", "--dataset", "--run", "--store")
    accelerator = Accelerator(cpu=True)
    tg = TrainguardAccelerate(accelerator, args.redis, dataset=args.dataset, run=args.run,
                              store=args.store, batch_size=args.batch_size, keep_last=2,
                              block_ms=200)
    model = Ledger(args.n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, tg.dataloader())
    step = tg.load_state()
    say("READY")
    for batch in loader:
        # Records are 8 tokens; an empty batch (a rank out of data) has zero rows.
        loss = model(input_ids=batch.long().reshape(-1, 8))["loss"]
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        say(f"STEP {step}")
        time.sleep(args.sleep_ms / 1000)
        if step % args.ckpt_every == 0:
            say(f"SAVE {step}")
            tg.save_state(step)
            say(f"COMMITTED {step}")
    tg.save_state(step)
    tg.close()
    say(f"DONE {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
