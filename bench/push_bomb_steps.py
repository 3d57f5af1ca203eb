"""The service's longest event-loop step, in CPU time of the loop's thread, while each
decoding bomb of ``bench/push_bombs.py`` is pushed: the decode pool (``--decode-workers
2``, the default) against every body parsed on the loop (``--decode-workers 0``), in
one run, rounds interleaved.

CPU time, not wall time: on a machine whose cores are all busy the scheduler's waits
dominate any wall-clock stall (``bench/push.py --bombs-only`` measures those), while a
step's CPU is what the loop cannot serve anyone else during, whatever the load. Both
services run through ``bench/_serve_steps.py`` with ``TRAINGUARD_SLOW_STEP_MS=1`` (each
step over 1 ms logged); per round and bomb, ``--pushes`` pushes are sent to each, one
after the other, and the longest step logged during them is that round's figure.
Prints per bomb the median and range over rounds for each, and the load average.
With ``--compare-root DIR`` the first service is the pool service of another source
tree (e.g. the commit before a change: ``git archive <commit> | tar -x -C DIR``)
instead of this tree's ``--decode-workers 0``.
Usage: python bench/push_bomb_steps.py [--rounds 3] [--pushes 4] [--compare-root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from push_bombs import BOMBS, _bombs  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from ingest_service.datasets import create_dataset  # noqa: E402
from tests.servers import RedisServer, free_port  # noqa: E402
from trainguard.core import streams  # noqa: E402
from trainguard.core.process import http_ready, wait_until  # noqa: E402

TOKEN = "bench-steps-token-0123456789"
_SLOW = re.compile(r"^SLOW (\d+\.\d+) (\d+\.\d+) ms")


def _steps(log: Path, start: float, end: float) -> float:
    """The longest step logged between ``start`` and ``end`` (0: none over 1 ms)."""
    worst = 0.0
    for line in log.read_text().splitlines():
        m = _SLOW.match(line)
        if m and start <= float(m.group(1)) <= end:
            worst = max(worst, float(m.group(2)))
    return worst


async def _push(session: aiohttp.ClientSession, base: str, dataset: str, name: str,
                pushes: int) -> dict[int, int]:
    content_type, body = _bombs()[name]
    statuses: dict[int, int] = {}
    for _ in range(pushes):
        async with session.post(f"{base}/v1/datasets/{dataset}/records",
                                params={"producer_id": f"bomber-{name}", "seq": "0"},
                                headers={"Content-Type": content_type,
                                         "Authorization": f"Bearer {TOKEN}"},
                                data=body) as resp:
            await resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
    return statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=4, help="per bomb, round and service")
    parser.add_argument("--compare-root", type=Path, default=None,
                        help="the first service from this source tree, with its decode pool")
    args = parser.parse_args()
    first = (("inline", ROOT, "0") if args.compare_root is None
             else ("baseline", args.compare_root.resolve(), "2"))
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-steps-"))
    server = RedisServer(tmp / "redis").start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_PUSH_TOKENS": f"{TOKEN}:steps-*:*", "TRAINGUARD_SLOW_STEP_MS": "1"}
    services: dict[str, tuple[str, Path, subprocess.Popen[bytes]]] = {}
    try:
        for label, root, workers in (first, ("pool", ROOT, "2")):
            port, log = free_port(), tmp / f"{label}.log"
            proc = subprocess.Popen(
                [sys.executable, str(root / "bench" / "_serve_steps.py"), "--port", str(port),
                 "--no-produce", "--decode-workers", workers], env={**env, "PYTHONPATH": str(root)},
                cwd=root,  # `python -m` puts the cwd first: the decode workers are root's too
                stdout=subprocess.DEVNULL, stderr=log.open("wb"))
            services[label] = (f"http://127.0.0.1:{port}", log, proc)
        for base, _, _proc in services.values():
            if not wait_until(functools.partial(http_ready, f"{base}/readyz"), 60):
                raise RuntimeError("a service did not become ready")
        print(f"load average at start {os.getloadavg()[0]:.1f}")

        async def run() -> dict[str, dict[str, list[float]]]:
            r = Redis.from_url(server.url)
            for label in services:
                await create_dataset(r, streams.DatasetSpec(name=f"steps-{label}", partitions=4,
                                                            format="push"))
            await r.aclose()
            out: dict[str, dict[str, list[float]]] = {lb: {n: [] for n in BOMBS}
                                                      for lb in services}
            async with aiohttp.ClientSession() as session:
                for n in range(args.rounds):
                    for name in BOMBS:
                        order = list(services) if n % 2 == 0 else list(reversed(services))
                        for label in order:
                            base, log, _ = services[label]
                            start = time.time()
                            answers = await _push(session, base, f"steps-{label}", name,
                                                  args.pushes)
                            await asyncio.sleep(0.2)  # the log written
                            out[label][name].append(_steps(log, start, time.time()))
                            if n == 0:
                                print(f"  round 0 {label:>6} {name:>13}: answers {answers}")
                    print(f"round {n} done, load average {os.getloadavg()[0]:.1f}")
            return out

        out = asyncio.run(run())
        print("longest loop step, CPU ms of the loop's thread, median (range) over rounds:")
        for name in BOMBS:
            cells = []
            for label in services:
                s = sorted(out[label][name])
                cells.append(f"{label} {statistics.median(s):.1f} ({s[0]:.1f}-{s[-1]:.1f})")
            print(f"  {name:>13}: " + "; ".join(cells))
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        for _, _, proc in services.values():
            proc.terminate()
            proc.wait(30)
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
