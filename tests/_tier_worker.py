"""Subprocess for the kill -9 test: save step 1 into a tiered store, then wait for
its upload. The test sets TRAINGUARD_CKPT_CRASH_AT to an upload phase, so this
process SIGKILLs itself in the middle of the upload.

argv: local_dir remote_url storage_options_json
"""

from __future__ import annotations

import json
import sys

from tests._ckpt_helpers import state_for
from tests._tier_helpers import open_tiered


def main() -> int:
    local, remote, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    store = open_tiered(local, remote, options)
    store.save(state_for(1, width=64), step=1, blocking=True)
    store.wait_uploads(60.0)
    print("upload finished without the injected crash", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
