"""Subprocesses of the tiered checkpoint tests.

``crash``: save step 1, then wait for its upload; the test sets
TRAINGUARD_CKPT_CRASH_AT to an upload phase, so the process SIGKILLs itself in the
middle of the upload.

``outage``: save step 1; the test sets TRAINGUARD_CKPT_STOP_AT=upload-mid-data, so
the process SIGSTOPs itself in the middle of that upload. The test stops S3, creates
``go_file`` and sends SIGCONT; the worker then saves steps 2..5 (S3 still down),
once an upload failed and the breaker left "closed" prints ``SAVED <local steps>
<tier states> <breaker state>``, waits for every upload (the test brings S3 back)
and prints ``UPLOADED <drained> <local steps> <tier states> <breaker state>``.

argv: mode local_dir remote_url storage_options_json [go_file]
"""

from __future__ import annotations

import json
import os
import sys
import time

from checkpoint_store import CheckpointStore
from checkpoint_store._faults import STOP_ENV
from tests._ckpt_helpers import state_for
from tests._tier_helpers import open_tiered

WIDTH = 64
CHUNK_BYTES = 4096  # the 64x64 weight becomes 4 chunk files: "mid-data" is mid-way


def _local_steps(local: str) -> list[int]:
    return [m.step for m in CheckpointStore(local).list()]


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def main() -> int:
    mode, local, remote, options = sys.argv[1:5]
    store = open_tiered(local, remote, json.loads(options), chunk_bytes=CHUNK_BYTES)
    store.save(state_for(1, width=WIDTH), step=1, blocking=True)
    if mode == "crash":
        store.wait_uploads(60.0)
        print("upload finished without the injected crash", flush=True)
        return 3
    go_file = sys.argv[5]
    while not os.path.exists(go_file):
        time.sleep(0.02)
    os.environ.pop(STOP_ENV, None)  # the retried upload must not stop again
    for step in range(2, 6):
        store.save(state_for(step, width=WIDTH), step=step, blocking=False).wait()
    while store.upload_failures == 0 or store.breaker.state.value == "closed":
        time.sleep(0.02)
    print("SAVED", _compact(_local_steps(local)), _compact([t.state for t in store.tiers()]),
          store.breaker.state.value, flush=True)
    drained = store.wait_uploads(90.0)
    print("UPLOADED", _compact(drained), _compact(_local_steps(local)),
          _compact([t.state for t in store.tiers()]), store.breaker.state.value, flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
