"""Redis memory a dataset takes, per record, by record size: the figures of
``docs/concepts.md``'s sizing section.

For each payload size, starts a fresh redis-server (``tests/servers.py``, no
persistence), ingests N records of that many bytes (an int32 npy source through
``trainguard ingest``, 4 partitions, one epoch) and reads ``used_memory`` before and
after. Prints bytes of Redis memory per record and the overhead over the payload.

    .venv/bin/python bench/redis_sizing.py [--records 20000] [--sizes 16,64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.servers import RedisServer  # noqa: E402


def measure(size: int, records: int, tmp: Path) -> float:
    """Redis bytes per record of ``size`` payload bytes."""
    server = RedisServer(tmp / f"redis-{size}").start()
    try:
        src = tmp / f"rec-{size}.npy"
        np.save(src, np.arange(records * (size // 4), dtype=np.int32))
        client = redis.Redis.from_url(server.url)
        before = int(client.info("memory")["used_memory"])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "trainguard", "ingest", "--redis-url", server.url,
                        "--dataset", f"size{size}", "--source", str(src), "--format", "npy",
                        "--sample-len", str(size // 4), "--partitions", "4", "--epochs", "1"],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        after = int(client.info("memory")["used_memory"])
        client.close()
        return (after - before) / records
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000, help="records per size")
    parser.add_argument("--sizes", default="16,64,256,1024,4096",
                        help="payload bytes per record, comma-separated (multiples of 4)")
    args = parser.parse_args()
    print("| payload B | Redis B per record | overhead B |")
    print("| ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            per = measure(size, args.records, Path(tmp))
            print(f"| {size} | {per:,.0f} | {per - size:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
