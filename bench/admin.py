"""``/admin/runs`` time at 10 and at 1,000 manifests (300 tensors each, in 50 runs).

Against one fresh redis-server and one ``trainguard serve`` process per size. The
manifests are real (valid checksums, session records), cloned from one save with a
new step, uid and run each (their data is not needed: listing reads manifests only).
Reports the cold request (every manifest read and parsed once) and the median of the
warm ones (the cache holds them: one listing of the root); the target is warm at
1,000 manifests within 5x warm at 10.

    PYTHONPATH=$PWD python bench/admin.py
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from push import wait_ready  # noqa: E402

from checkpoint_store import CheckpointStore  # noqa: E402
from checkpoint_store.manifest import encode_manifest  # noqa: E402
from tests.servers import RedisServer, free_port  # noqa: E402

RUNS = 50
TENSORS = 300


def make_root(root: Path, manifests: int) -> None:
    """``manifests`` committed manifests of 300 tensors each, in ``RUNS`` runs."""
    store = CheckpointStore(root, keep_last=10**6)
    state = {f"layer{i}.weight": torch.zeros(4, 4) for i in range(TENSORS)}
    tg = {"dataset": "bench", "run": "run0", "offsets": {"0": "1-0"}}
    m = store.save(state, step=0, extra={"trainguard": tg}).wait()
    store.close()
    path = root / "manifests" / m.name
    doc = json.loads(path.read_bytes())
    path.unlink()
    for i in range(manifests):
        uid = f"{int(doc['uid'][:16], 16) + i:016x}{doc['uid'][16:]}"
        run = f"run{i % RUNS}"
        extra = {"trainguard": {**doc["extra"]["trainguard"], "run": run, "commit": i}}
        raw = encode_manifest(step=i, uid=uid, created_at=doc["created_at"] + i, parent=None,
                              world_size=1, extra=extra, arrays=doc["arrays"],
                              tensors=doc["tensors"],
                              state=base64.b64decode(doc["state"]["base64"]))
        (root / "manifests" / f"{i:012d}-{uid}.json").write_bytes(raw)


def get_ms(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as resp:
        resp.read()
    return (time.perf_counter() - start) * 1000


def measure(manifests: int, warm_rounds: int) -> tuple[float, float]:
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-admin-"))
    make_root(tmp / "ck", manifests)
    server = RedisServer(tmp / "redis").start()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_CHECKPOINT_STORES": f"main={tmp / 'ck'}"}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "serve", "--port", str(port),
                             "--no-produce"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc)
        cold = get_ms(f"{base}/admin/runs")
        warm = statistics.median(get_ms(f"{base}/admin/runs") for _ in range(warm_rounds))
        return cold, warm
    finally:
        proc.terminate()
        proc.wait(30)
        server.stop()


def report_sizes(sizes: list[int], warm_rounds: int) -> Iterator[str]:
    """The table's lines, each as soon as its size is measured, then the warm ratio."""
    results = {}
    yield f"{'manifests':>9} | {'cold ms':>9} | {'warm ms (median)':>16}"
    for n in sizes:
        cold, warm = measure(n, warm_rounds)
        results[n] = warm
        yield f"{n:>9} | {cold:>9.1f} | {warm:>16.1f}"
    small, big = results[min(results)], results[max(results)]
    yield f"warm {max(results)} / warm {min(results)}: {big / small:.1f}x (target <= 5x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--warm-rounds", type=int, default=9)
    args = parser.parse_args()
    for line in report_sizes(args.sizes, args.warm_rounds):
        print(line, flush=True)


if __name__ == "__main__":
    main()
