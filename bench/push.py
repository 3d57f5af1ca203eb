"""Push benchmark: HTTP push through ``trainguard serve`` against raw pipelined XADD.

In one run, against one fresh redis-server and one ``trainguard serve`` process (both
started here on free ports; the service with a producer token, no file producers):

1. Ratio, closed loop, ``--rounds`` rounds of service then raw back to back (paired):
   ``--producers`` concurrent producers each send ``--batches`` batches of
   ``--records`` records of ``--record-bytes`` bytes; through the service (aiohttp
   client, msgpack bodies, one producer_id each, seqs 0, 1, ...) and as raw pipelined
   XADDs of the same encoded entries to the same partitions (redis-py, one pipeline
   per batch), both from this process: the ordinary Python client of each. Prints the
   batches/s of each and the median and range of the per-round ratio.
2. Saturation: the same closed loop through the service, from the light load generator
   (``bench/push_load.py``: pre-encoded requests over raw asyncio streams, one
   keep-alive connection per producer, in a process of its own, so the client's own
   CPU and pauses are not counted as the service's). The median over
   ``--sat-rounds`` is the service's saturation rate.
3. Latency, open loop at half that rate, ``--latency-rounds`` rounds of ``--seconds``
   from the light generator: every producer sends on its own schedule (evenly
   staggered, or Poisson with ``--arrivals poisson``), and a batch's latency counts
   from its scheduled send time, so a producer still waiting for its previous answer
   counts the wait (no coordinated omission). Prints p50/p99 per round, and over all.
4. The same open loop while one more client (aiohttp, in this process) sends the
   worst-case push in a loop: a body at the byte limit of records that all parse, the
   last one over the dataset's record limit, so every one is read, parsed and refused
   (413).
5. The event loop's worst stall while one client sends each kind of decoding bomb
   (``bench/push_bombs.py``): /healthz probed one after the other, with no bomb and
   beside each bomb; ``--bombs-only`` runs this phase alone.
6. ``/admin/runs`` at 10 and at 1,000 manifests (``bench/admin.py``: a service and a
   store root of its own per size), cold and warm, and the warm ratio (target <= 5x);
   ``--admin-only`` runs this phase alone.

Each phase (each round) pushes to a push dataset of its own, deleted after it: with no
consumer committing here, the service's backlog view then starts empty every time and
never nears its bound (429), however fast the machine. Each phase prints the CPU it
cost per batch in the load generator, the service and redis-server (from /proc), and
the service's RSS; the load average is printed at the start and the end. Not a test: on a shared 2-core machine the load generator, the
service and Redis share the cores, and other work on the machine shows in the tail.
Runs in about a minute and a half with the defaults.
Usage: python bench/push.py [--rounds 4] [--latency-rounds 3] [--seconds 8]
       python bench/push.py --bombs-only [--steps steps.log]  (each loop step over 1 ms
       of CPU in the service, with where it began and ended: bench/_serve_steps.py; the
       longest beside each bomb is reported against the no-bomb /healthz p99)
       python bench/push.py --bombs-only --compare-inline  (the decode pool against the
       same service parsing every body on its loop, --decode-workers 0, interleaved)
       python bench/push.py --bombs-only --compare-root DIR  (this tree's service against
       the same service from another source tree, e.g. the commit before a change,
       exported with `git archive <commit> | tar -x -C DIR`, interleaved)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from redis.asyncio import Redis  # noqa: E402
from rounds import process_cpu_s  # noqa: E402

from ingest_service.datasets import create_dataset, delete_dataset  # noqa: E402
from ingest_service.push.ingest import choose_partition  # noqa: E402
from tests.servers import RedisServer, free_port  # noqa: E402
from trainguard.core import streams  # noqa: E402
from trainguard.core.process import http_ready, wait_until  # noqa: E402

TOKEN = "bench-producer-token-0123456789"
OTHER_TOKEN = "bench-hostile-token-0123456789"
"""The worst-case and bomb clients' own token: each token has its share of the body
budget, and these clients are not the producers'."""
DATASET, PARTITIONS = "rollouts", 16


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


class Bench:
    def __init__(self, args: argparse.Namespace, redis_url: str, base: str) -> None:
        self.args, self.redis_url, self.base = args, redis_url, base
        self.payload = os.urandom(args.record_bytes)
        self.body = msgpack.packb([self.payload] * args.records, use_bin_type=True)
        self.fields = streams.encode_record(self.payload)
        self.seqs: dict[str, int] = {}
        self.generation = 0

    def producer_ids(self) -> list[str]:
        return [f"actor-{self.generation}-{i}" for i in range(self.args.producers)]

    @property
    def dataset(self) -> str:
        """A dataset per phase: the service's backlog view (no consumer commits here)
        starts empty each time, never near its bound however fast the machine."""
        return f"{DATASET}-{self.generation}"

    async def next_phase(self) -> None:
        self.generation += 1
        r = Redis.from_url(self.redis_url)
        await create_dataset(r, streams.DatasetSpec(name=self.dataset, partitions=PARTITIONS,
                                                    format="push", max_record_bytes=4096))
        await r.aclose()

    async def push(self, session: aiohttp.ClientSession, producer: str) -> float:
        seq = self.seqs.get(producer, 0)
        start = time.perf_counter()
        async with session.post(f"{self.base}/v1/datasets/{self.dataset}/records",
                                params={"producer_id": producer, "seq": str(seq)},
                                data=self.body, headers={
                                    "Authorization": f"Bearer {TOKEN}",
                                    "Content-Type": "application/msgpack"}) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"push answered {resp.status}: {await resp.text()}")
        self.seqs[producer] = seq + 1
        return time.perf_counter() - start

    async def raw(self, r: Redis, producer: str) -> float:
        key = streams.partition_key("raw", choose_partition(producer, PARTITIONS))
        start = time.perf_counter()
        async with r.pipeline(transaction=False) as pipe:
            for _ in range(self.args.records):
                pipe.xadd(key, self.fields)  # type: ignore[arg-type]
            await pipe.execute()
        return time.perf_counter() - start

    async def closed_loop(self, kind: str) -> tuple[float, list[float]]:
        await self.next_phase()
        latencies: list[float] = []
        r = Redis.from_url(self.redis_url, max_connections=256)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            async def one(producer: str) -> None:
                for _ in range(self.args.batches):
                    latencies.append(await (self.push(session, producer) if kind == "service"
                                            else self.raw(r, producer)))

            start = time.perf_counter()
            await asyncio.gather(*(one(p) for p in self.producer_ids()))
            elapsed = time.perf_counter() - start
        await self.trim(r)
        await r.aclose()
        return len(latencies) / elapsed, latencies

    async def trim(self, r: Redis) -> None:
        await delete_dataset(r, self.dataset)
        for p in range(PARTITIONS):
            await r.delete(streams.partition_key("raw", p))

    def load(self, mode: str, **options: object) -> dict[str, Any]:
        """Run the light load generator once (its own process); its JSON result."""
        asyncio.run(self.next_phase())
        out = json.loads(subprocess.run(self.load_command(mode, **options), check=True,
                                         capture_output=True, text=True).stdout)
        asyncio.run(self.clear())
        return out  # type: ignore[no-any-return]

    async def clear(self) -> None:
        r = Redis.from_url(self.redis_url)
        await self.trim(r)
        await r.aclose()

    def load_command(self, mode: str, **options: object) -> list[str]:
        cmd = [sys.executable, str(ROOT / "bench" / "push_load.py"), "--port",
               self.base.rsplit(":", 1)[1], "--token", TOKEN, "--mode", mode, "--prefix",
               f"load-{self.generation}", "--dataset", self.dataset, "--producers", str(self.args.producers),
               "--records", str(self.args.records), "--record-bytes", str(self.args.record_bytes)]
        for k, v in options.items():
            cmd += [f"--{k}", str(v)]
        return cmd

    async def load_beside_worst(self, **options: object) -> tuple[dict[str, Any], int]:
        """The open-loop generator while this process sends the worst-case push in a
        loop; the generator's result and the worst-case requests refused (413)."""
        await self.next_phase()
        refused = 0
        body = worst_case_body(self.args.max_push_bytes)
        proc = await asyncio.create_subprocess_exec(*self.load_command("open", **options),
                                                    stdout=asyncio.subprocess.PIPE)
        async with aiohttp.ClientSession() as session:
            async def worst() -> None:
                nonlocal refused
                while proc.returncode is None:
                    async with session.post(
                        f"{self.base}/v1/datasets/{self.dataset}/records",
                        params={"producer_id": "attacker", "seq": "0"}, data=body,
                        headers={"Authorization": f"Bearer {OTHER_TOKEN}",
                                 "Content-Type": "application/x-ndjson"},
                    ) as resp:
                        await resp.read()
                        if resp.status != 413:
                            raise RuntimeError(f"the worst-case push answered {resp.status}")
                        refused += 1

            task = asyncio.create_task(worst())
            out, _ = await proc.communicate()
            await task
        if proc.returncode:
            raise RuntimeError(f"the load generator failed ({proc.returncode})")
        await self.clear()
        return json.loads(out), refused


class Cpu:
    """CPU seconds of the service and redis-server over a phase, per batch."""

    def __init__(self, service_pid: int, redis_pid: int) -> None:
        self.pids = (service_pid, redis_pid)
        self.start = tuple(process_cpu_s(p) for p in self.pids)

    def per_batch(self, batches: int, generator_s: float) -> str:
        service, redis = (process_cpu_s(p) - s for p, s in zip(self.pids, self.start, strict=True))
        return (f"CPU ms/batch: generator {generator_s / batches * 1000:.2f}, service "
                f"{service / batches * 1000:.2f}, redis-server {redis / batches * 1000:.2f}")


def worst_case_body(limit: int) -> bytes:
    """Lines of ~1.6 KB JSON arrays up to the byte limit, the last line a record over
    the dataset's max_record_bytes: everything is read and parsed, then refused."""
    line = ("[" + ",".join(["100"] * 400) + "]\n").encode()
    last = b'"' + b"z" * 5000 + b'"\n'
    count = min(9_999, (limit - len(last)) // len(line))
    return line * count + last


def wait_ready(base: str, proc: subprocess.Popen[bytes]) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("trainguard serve exited")
        return http_ready(f"{base}/readyz")

    if not wait_until(up, 60):
        raise RuntimeError("trainguard serve did not become ready")


def summary(lat: list[float]) -> str:
    return f"p50 {pct(lat, .5):.1f} ms p99 {pct(lat, .99):.1f} ms over {len(lat)} batches"


def loadavg() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def paired_bombs(bench: Bench, args: argparse.Namespace,
                 bases: dict[str, tuple[str, int]]) -> None:
    from push_bombs import paired_bomb_phase, paired_report

    async def run() -> dict[str, list[dict[str, Any]]]:
        r = Redis.from_url(bench.redis_url)
        named: dict[str, tuple[str, str, int | None]] = {}
        for label, (base, pid) in bases.items():
            name = f"{DATASET}-bombs-{label.split()[0]}"
            await create_dataset(r, streams.DatasetSpec(name=name, partitions=PARTITIONS,
                                                        format="push"))
            named[label] = (base, name, pid)
        await r.aclose()
        return await paired_bomb_phase(named, OTHER_TOKEN, args.bomb_seconds, args.bomb_rounds)

    print(f"5. the loop beside decoding bombs, {' vs '.join(bases)} ({args.bomb_rounds} rounds "
          f"interleaved, {args.bomb_seconds:.0f} s each, one bomb client, /healthz probed one "
          f"after the other)")
    for line in paired_report(asyncio.run(run())):
        print(line)


def bombs(bench: Bench, args: argparse.Namespace, base: str, pid: int) -> None:
    from push_bombs import bomb_phase, report, step_report

    async def run() -> list[dict[str, Any]]:
        r = Redis.from_url(bench.redis_url)
        name = f"{DATASET}-bombs"  # records up to 16 MiB: the byte limits let bombs in
        await create_dataset(r, streams.DatasetSpec(name=name, partitions=PARTITIONS,
                                                    format="push"))
        await r.aclose()
        return await bomb_phase(base, name, OTHER_TOKEN, args.bomb_seconds, args.bomb_rounds,
                                pid)

    print(f"5. the loop beside decoding bombs ({args.bomb_rounds} rounds interleaved, "
          f"{args.bomb_seconds:.0f} s each, one bomb client, /healthz probed one after the other)")
    rounds = asyncio.run(run())
    for line in report(rounds):
        print(line)
    if args.steps:
        time.sleep(0.5)  # the service's last lines written
        for line in step_report(rounds, args.steps):
            print(line)


def admin_phase() -> None:
    """Phase 6: the catalog's cost at 10 and 1,000 manifests (``bench/admin.py``)."""
    from admin import RUNS, TENSORS, report_sizes

    print(f"6. /admin/runs at 10 and 1,000 manifests ({TENSORS} tensors each, in {RUNS} "
          "runs; a service of its own per size)")
    for line in report_sizes([10, 1000], warm_rounds=9):
        print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="ratio rounds")
    parser.add_argument("--producers", type=int, default=32)
    parser.add_argument("--batches", type=int, default=20, help="per producer per round")
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--sat-rounds", type=int, default=3, help="saturation rounds")
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per open-loop round")
    parser.add_argument("--arrivals", choices=("even", "poisson"), default="even")
    parser.add_argument("--max-push-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--bomb-seconds", type=float, default=3.0, help="per bomb, phase 5")
    parser.add_argument("--bomb-rounds", type=int, default=3, help="phase 5 rounds")
    parser.add_argument("--bombs-only", action="store_true", help="run phase 5 alone")
    parser.add_argument("--admin-only", action="store_true", help="run phase 6 alone")
    parser.add_argument("--compare-inline", action="store_true",
                        help="with --bombs-only: a second service with --decode-workers 0 "
                             "(every body parsed on the loop), rounds interleaved, paired ratios")
    parser.add_argument("--compare-root", type=Path, default=None,
                        help="with --bombs-only: a second service run from this source tree "
                             "(e.g. `git archive <commit>` of the code before a change), rounds "
                             "interleaved, paired ratios")
    parser.add_argument("--steps", type=Path, default=None,
                        help="serve through bench/_serve_steps.py: each loop step over 1 ms "
                             "of CPU is written to this file (where it started and ended)")
    args = parser.parse_args()
    if args.admin_only:
        admin_phase()
        return
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-push-"))
    server = RedisServer(tmp / "redis").start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_PUSH_TOKENS": f"{TOKEN}:{DATASET}-*:*;{OTHER_TOKEN}:{DATASET}-*:*",
           "TRAINGUARD_SLOW_STEP_MS": os.environ.get("TRAINGUARD_SLOW_STEP_MS", "1")}
    command = [str(ROOT / "bench" / "_serve_steps.py")] if args.steps else ["-m", "trainguard",
                                                                          "serve"]
    stderr = args.steps.open("wb") if args.steps else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, *command, "--port", str(port), "--no-produce"],
                            env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_ready(base, proc)
        bench = Bench(args, server.url, base)
        redis_pid = server.pid
        assert redis_pid is not None
        print(f"{args.producers} producers x batches of {args.records} x {args.record_bytes} B; "
              f"redis :{server.port}, service :{port} (pid {proc.pid}); {loadavg()}")
        rss0 = rss_mb(proc.pid)
        if args.bombs_only and (args.compare_inline or args.compare_root):
            # The baseline: this tree with every body parsed on the loop, or another tree.
            other_port = free_port()
            if args.compare_root:
                root = args.compare_root.resolve()
                other_env, extra = {**env, "PYTHONPATH": str(root)}, []
                label = f"baseline ({root.name})"
            else:
                root, other_env, extra = ROOT, env, ["--decode-workers", "0"]
                label = "inline (decode-workers 0)"
            other = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "serve", "--port", str(other_port),
                 "--no-produce", *extra], env=other_env, cwd=root, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            try:
                wait_ready(f"http://127.0.0.1:{other_port}", other)
                paired_bombs(bench, args, {label: (f"http://127.0.0.1:{other_port}", other.pid),
                                           "this tree (decode-workers 2)": (base, proc.pid)})
            finally:
                other.terminate()
                other.wait(30)
            print(loadavg())
            return
        if args.bombs_only:
            bombs(bench, args, base, proc.pid)
            return
        ratios: list[float] = []
        print("1. ratio, closed loop, aiohttp client -> service vs redis-py pipeline -> Redis")
        print(f"{'round':>5} | {'service batch/s':>15} | {'raw batch/s':>11} | {'ratio':>5} | "
              f"{'service RSS MB':>14}")
        client_ms: list[float] = []
        for n in range(args.rounds):
            client = time.process_time()
            svc_rate, svc_lat = asyncio.run(bench.closed_loop("service"))
            client_ms.append((time.process_time() - client) / len(svc_lat) * 1000)
            raw_rate, _ = asyncio.run(bench.closed_loop("raw"))
            ratios.append(svc_rate / raw_rate)
            print(f"{n:>5} | {svc_rate:>15,.0f} | {raw_rate:>11,.0f} | {ratios[-1]:>5.2f} | "
                  f"{rss_mb(proc.pid):>14.0f}")
        ratios.sort()
        ratio = f"{statistics.median(ratios):.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f})"
        print(f"ratio service/raw: median {ratio}; the aiohttp client's CPU per service batch "
              f"{statistics.median(client_ms):.2f} ms")

        print("2. saturation, closed loop, light generator -> service")
        rates: list[float] = []
        for n in range(args.sat_rounds):
            cpu = Cpu(proc.pid, redis_pid)
            r = bench.load("closed", batches=args.batches)
            rates.append(r["rate"])
            print(f"  round {n}: {r['rate']:,.0f} batch/s, {summary(r['latencies'])}; "
                  f"{cpu.per_batch(len(r['latencies']), r['cpu_s'])}")
        half = statistics.median(rates) / 2

        print(f"3. open loop at half saturation ({half:,.0f} batch/s, {args.arrivals} arrivals, "
              f"latency from the scheduled send)")
        p99s: list[float] = []
        lat: list[float] = []
        for n in range(args.latency_rounds):
            cpu = Cpu(proc.pid, redis_pid)
            r = bench.load("open", rate=half, seconds=args.seconds, arrivals=args.arrivals,
                           seed=n)
            lat += r["latencies"]
            p99s.append(pct(r["latencies"], .99))
            print(f"  round {n}: {summary(r['latencies'])} (sent late p99 "
                  f"{pct(r['late'], .99):.1f} ms); {cpu.per_batch(len(r['latencies']), r['cpu_s'])}")
        p99s.sort()

        cpu = Cpu(proc.pid, redis_pid)
        r, refused = asyncio.run(bench.load_beside_worst(
            rate=half, seconds=args.seconds, arrivals=args.arrivals, seed=99))
        worst = r["latencies"]
        print(f"4. the same + a worst-case client "
              f"({len(worst_case_body(args.max_push_bytes)) / 2**20:.1f} MiB bodies, {refused} "
              f"refused with 413): {summary(worst)}; "
              f"{cpu.per_batch(len(worst), r['cpu_s'])} (worst-case client's not counted)")
        print(f"service RSS {rss_mb(proc.pid):.0f} MB (at start {rss0:.0f} MB); {loadavg()}")
        print(f"HEADLINE ratio {ratio} (target >= 0.5); saturation "
              f"{statistics.median(rates):,.0f} batch/s; at half of it p50 {pct(lat, .5):.1f} ms, "
              f"p99 {pct(lat, .99):.1f} ms over all rounds (per round {p99s[0]:.1f}-{p99s[-1]:.1f}; "
              f"target < 50); beside the worst-case client p99 {pct(worst, .99):.1f} ms "
              f"(target < 100)")
        bombs(bench, args, base, proc.pid)
        admin_phase()
    finally:
        proc.terminate()
        proc.wait(30)
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
