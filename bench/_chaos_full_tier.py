"""The campaign's ``full_local_tier`` class: one process training with a
``TieredCheckpointStore`` whose local tier is a 1 MiB tmpfs (a private mount
namespace, ``unshare -Urm``) filled to ENOSPC, killed hard (``os._exit(9)``) after
step 7, then started again (as an agent would).

Not the 3-node job: the tiered store is single-process. Handled when both attempts
ran, the second restored from the remote tier and finished, and the final
checkpoint's ledger holds every record exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests import _client_fill as cf
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[1]
RECORDS = 40
CRASH_AT = 7

__all__ = ["full_local_tier"]


def full_local_tier(work: Path, reps: int) -> dict[str, Any]:
    """``reps`` rounds of the scenario above, each on a fresh Redis and fresh roots."""
    from _chaos_job import _ledger  # the campaign's ledger reader

    events: list[dict[str, Any]] = []
    lost = duplicated = once = 0
    finished = True
    t0 = time.monotonic()
    for rep in range(reps):
        redis = RedisServer(work / f"full-{rep}" / "redis").start()
        try:
            spec = cf.create(redis.url, "heal", partitions=1)
            cf.fill(redis.url, spec, RECORDS)
            mnt, remote = work / f"full-{rep}" / "local", f"file://{work}/full-{rep}/remote"
            mnt.mkdir(parents=True)
            job = f"{sys.executable} -m tests._tier_full_job {redis.url} {mnt} {remote} {RECORDS}"
            script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} || exit 90; "
                      f"{job} --crash-at {CRASH_AT}; echo \"FIRST $? $(date +%s.%N)\"; "
                      f"exec {job}")
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=300)
        finally:
            redis.kill()
        lines = proc.stdout.strip().splitlines()
        first = next((x.split() for x in lines if x.startswith("FIRST ")), None)
        step_at = next((float(x.split()[1]) for x in lines if x.startswith("FIRST_STEP ")),
                       None)
        ok = proc.returncode == 0 and first is not None and first[1] == "9"
        out = json.loads(lines[-1]) if ok else {}
        counts, _ = _ledger(remote, RECORDS) if ok else (None, 0)
        rep_lost = RECORDS if counts is None else int((counts == 0).sum())
        rep_dup = 0 if counts is None else int((counts - 1).clamp(min=0).sum())
        handled = ok and rep_lost == rep_dup == 0 and out.get("remote_only_saves", 0) >= 1
        finished = finished and ok
        lost, duplicated = lost + rep_lost, duplicated + rep_dup
        once += 0 if counts is None else int((counts == 1).sum())
        events.append({"class": "full_local_tier", "handled": handled,
                       "resume_s": None if step_at is None or first is None
                       else step_at - float(first[2]),
                       "remote_only_saves": out.get("remote_only_saves"),
                       "stderr_tail": None if ok else proc.stderr[-1500:]})
    return {"finished": finished, "lost": lost, "duplicated": duplicated, "once": once,
            "records": RECORDS * reps, "trained": once, "events": events, "incidents": [],
            "wall_s": time.monotonic() - t0}
