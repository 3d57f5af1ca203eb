"""The worker of bench/rdzv_recovery.py: the ledger job (tests/_client_train.py), with
the moments its start-up is made of printed first.

``T <rank> START <epoch s>`` is when this process was created (from /proc, so it
includes the interpreter's own start), ``T <rank> IMPORTED <epoch s>`` when torch,
the trainer client and the checkpoint store are imported; then the ledger job's
``READY`` (process group and session made, checkpoint restored) and ``STEP`` lines.
"""

from __future__ import annotations

import os
import sys
import time


def _created_s() -> float:
    """This process' creation time, seconds since the epoch (Linux /proc)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # since boot
    age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age_s


def main() -> int:
    rank = os.environ.get("RANK", "0")
    print(f"T {rank} START {_created_s():.3f}", flush=True)
    import torch  # noqa: F401

    import checkpoint_store  # noqa: F401  (what the job's store= URL opens)
    import trainer_client  # noqa: F401

    print(f"T {rank} IMPORTED {time.time():.3f}", flush=True)
    from tests._client_train import main as ledger

    return ledger(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
