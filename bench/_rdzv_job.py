"""The worker of bench/rdzv_recovery.py: the ledger job (tests/_client_train.py), with
the moments its start-up is made of printed first.

``T <rank> START <epoch s>`` is when this process was created (from /proc, so it
includes the interpreter's own start; a warm worker: when its wrapper was),
``T <rank> IMPORTED <epoch s>`` when torch, the trainer client and the checkpoint
store are imported (a warm worker: they were, in the zygote, before the fork); then
the ledger job's ``READY`` (process group and session made, checkpoint restored) and ``STEP`` lines.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    rank = os.environ.get("RANK", "0")
    # From /proc (a warm worker: its wrapper's start), so importing it costs nothing here.
    from trainguard.core.process import started_at

    print(f"T {rank} START {started_at() or 0.0:.3f}", flush=True)
    import torch  # noqa: F401

    import checkpoint_store  # noqa: F401  (what the job's store= URL opens)
    import trainer_client  # noqa: F401

    print(f"T {rank} IMPORTED {time.time():.3f}", flush=True)
    from tests._client_train import main as ledger

    return ledger(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
