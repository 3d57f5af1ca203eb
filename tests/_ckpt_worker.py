"""Subprocess saver for the crash tests: saves ``state_for(step)`` and exits.

usage: python tests/_ckpt_worker.py URL STEP CHUNK_BYTES [STORAGE_OPTIONS_JSON|loop]
With ``loop`` it saves STEP, STEP+1, ... (alternating blocking and async) until
killed. The fault variables of ``checkpoint_store._faults`` (set by the test in this
process's environment) make the save crash, fail or stop at a chosen phase.
"""

from __future__ import annotations

import json
import sys

from checkpoint_store import CheckpointStore
from tests._ckpt_helpers import state_for


def main() -> None:
    url, step, chunk_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    loop = len(sys.argv) > 4 and sys.argv[4] == "loop"
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 and not loop else None
    store = CheckpointStore(url, storage_options=options, chunk_bytes=chunk_bytes,
                            keep_last=2)
    while loop:
        state = state_for(step, width=64)
        store.save(state, step=step, extra={"offsets": {"p0": f"1-{step}"}},
                   blocking=step % 2 == 0).wait()
        print("saved", step, flush=True)
        step += 1
    store.save(state_for(step, width=64), step=step, extra={"offsets": {"p0": f"1-{step}"}})
    store.close()
    print("saved", flush=True)


if __name__ == "__main__":
    main()
