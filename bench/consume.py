"""Consumer throughput: StreamingDataset against the raw Redis read limit and against
torch's own DataLoader limit, in interleaved rounds.

One redis-server (started here on a free port), a dataset of P partitions filled with
records of 8 KiB and of 128 KiB (NumPy uint8 arrays, the contract's ``nd`` kind). For
each size, every round runs (order rotated each round, first round discarded):

1. raw: pipelined XRANGE of every partition, replies read but not decoded (the
   limit of one process reading Redis);
2. StreamingDataset iterated in this process (fenced XREADGROUP, batch tensors);
3. baseline for the worker path: an in-memory ``IterableDataset`` yielding batch
   tensors of the same shape and bytes (a fresh tensor per batch, as any dataset
   that builds batches does) through ``DataLoader(num_workers=2)``: torch's own cost
   of moving batches between processes, with no Redis at all;
4. StreamingDataset through the same ``DataLoader(num_workers=2)``.

Prints a table (median seconds, GiB/s, client CPU s/GiB) and the headline ratios
(median of per-round ratios, with their range), then the time a checkpoint spends
committing offsets, with a ``TrainingSession`` on a local checkpoint store. Merges a
``consume`` section into the JSON results file.

    .venv/bin/python bench/consume.py                   # 256 MiB per size, 6 rounds
    .venv/bin/python bench/consume.py --mb 512 --rounds 6
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import redis
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rounds as rd  # noqa: E402

from tests.servers import RedisServer  # noqa: E402
from trainer_client import StreamingDataset, TrainingSession  # noqa: E402
from trainguard.core import streams  # noqa: E402

WORKERS = 2


def fill(url: str, name: str, partitions: int, size: int, count: int) -> None:
    spec = streams.DatasetSpec(name=name, partitions=partitions, source="bench://", format="npy",
                               sample_len=size)
    client = redis.Redis.from_url(url)
    client.hset(streams.meta_key(name), mapping=spec.to_redis())
    client.sadd(streams.datasets_key(), name)
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    fields = streams.encode_record(payload)
    per = [0] * partitions
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        p = i % partitions
        pipe.xadd(streams.partition_key(name, p), fields, id=streams.make_id(0, per[p]))
        per[p] += 1
        if i % 256 == 255:
            pipe.execute()
    pipe.execute()
    progress = {streams.PROGRESS_FINISHED: b"1"}
    for p in range(partitions):
        if per[p]:
            progress[streams.progress_end_field(p)] = streams.make_id(0, per[p] - 1).encode()
    client.hset(streams.progress_key(name), mapping=progress)
    client.close()


def raw_read(port: int, name: str, partitions: int, chunk: int) -> int:
    """Bytes of record payload read with pipelined XRANGE, replies parsed by hiredis
    but not turned into Python dicts (redis-py's response callbacks are bypassed)."""
    conn = redis.Connection(host="127.0.0.1", port=port)
    conn.connect()
    starts = {p: "-" for p in range(partitions)}
    total = 0
    while starts:
        order = list(starts)
        cmds = [("XRANGE", streams.partition_key(name, p), starts[p], "+", "COUNT", chunk)
                for p in order]
        conn.send_packed_command(conn.pack_commands(cmds))
        for p in order:
            entries = conn.read_response()
            for _eid, flat in entries:
                total += len(flat[3])  # k, kind, d, <payload>, ...
            if len(entries) < chunk:
                del starts[p]
            else:
                starts[p] = "(" + entries[-1][0].decode()
    conn.disconnect()
    return total


class InMemory(IterableDataset[torch.Tensor]):
    """``batches`` batch tensors like ``template``, split over the workers; each batch
    a fresh tensor (a clone), as a dataset that builds its batches yields them."""

    def __init__(self, template: torch.Tensor, batches: int):
        super().__init__()
        self.template = template
        self.batches = batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for _ in range(w, self.batches, n):
            yield self.template.clone()


class Consume:
    def __init__(self, url: str, port: int, name: str, partitions: int, size: int, count: int):
        self.url, self.port, self.name = url, port, name
        self.partitions, self.size, self.count = partitions, size, count
        self.batch = max(1, (1024 * 1024) // size)  # ~1 MiB batches
        self.groups = itertools.count()
        self.template = torch.from_numpy(
            np.random.default_rng(1).integers(0, 255, (self.batch, size), dtype=np.uint8))

    def _group(self) -> str:
        return f"grp-{next(self.groups)}"

    def raw(self) -> int:
        return raw_read(self.port, self.name, self.partitions, self.batch)

    def streaming(self, workers: int | None) -> int:
        ds = StreamingDataset(self.url, self.name, self._group(), batch_size=self.batch)
        source = ds if workers is None else DataLoader(ds, batch_size=None, num_workers=workers)
        total = 0
        for b in source:
            total += b.data.numel() * b.data.element_size()
        return total

    def in_memory(self) -> int:
        batches = -(-self.count // self.batch)
        loader = DataLoader(InMemory(self.template, batches), batch_size=None,
                            num_workers=WORKERS)
        total = 0
        for t in loader:
            total += t.numel() * t.element_size()
        return total

    def drop_groups(self, _: str) -> None:
        client = redis.Redis.from_url(self.url)
        for p in range(self.partitions):
            key = streams.partition_key(self.name, p)
            for g in client.xinfo_groups(key):
                client.xgroup_destroy(key, g["name"])
        client.close()


def commit_cost(url: str, name: str, store_dir: str, batch: int, rounds: int) -> list[float]:
    session = TrainingSession(url, dataset=name, run="commitbench", store=f"file://{store_dir}",
                              keep_last=2)
    model = torch.nn.Linear(16, 16)
    state = {"model": model}
    session.restore(state)
    it = iter(session.batches(session.dataset(batch_size=batch)))
    costs = []
    for step in range(1, rounds + 1):
        for _ in range(4):
            next(it)
        session.checkpoint(state, step, blocking=True)
        assert session.last_commit_offsets_s is not None
        costs.append(session.last_commit_offsets_s)
    session.close()
    return costs


RAW, ONE, BASE, DL = ("raw XRANGE", "StreamingDataset, 1 process",
                      f"in-memory IterableDataset, DataLoader({WORKERS} workers)",
                      f"StreamingDataset, DataLoader({WORKERS} workers)")


def measure_size(url: str, port: int, pid: int, args: argparse.Namespace, kib: int
                 ) -> tuple[rd.Rounds, list[rd.Ratio], int]:
    size = kib * 1024
    count = max(args.partitions, args.mb * 1024 * 1024 // size)
    name = f"bench{kib}"
    fill(url, name, args.partitions, size, count)
    c = Consume(url, port, name, args.partitions, size, count)
    contestants = {RAW: c.raw, ONE: lambda: c.streaming(None), BASE: c.in_memory,
                   DL: lambda: c.streaming(WORKERS)}
    r = rd.run_rounds(contestants, rounds=args.rounds, after=c.drop_groups, server_pid=pid)
    moved = {n: {s.nbytes for s in r.samples[n]} for n in contestants}
    assert all(v == {count * size} for v in moved.values()), (moved, count * size)
    client = redis.Redis.from_url(url)
    for p in range(args.partitions):
        client.delete(streams.partition_key(name, p))
    client.close()
    ratios = [
        rd.speed_ratio(r, DL, BASE, name=f"{kib} KiB: workers StreamingDataset / in-memory",
                       target=">= 0.8x"),
        rd.speed_ratio(r, ONE, RAW, name=f"{kib} KiB: 1-process StreamingDataset / raw XRANGE",
                       target=">= 0.8x" if kib == 128 else ""),
        rd.speed_ratio(r, DL, RAW, name=f"{kib} KiB: workers StreamingDataset / raw XRANGE"),
    ]
    return r, ratios, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="MiB of records per record size")
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--sizes-kib", default="8,128")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per size")
    ap.add_argument("--json", help="results file (default: bench/results/<host>-<stamp>.json)")
    args = ap.parse_args()
    out = rd.results_path() if args.json is None else Path(args.json)
    section: dict[str, object] = {"args": vars(args) | {"workers": WORKERS}, "sizes": {}}
    headlines: list[rd.Ratio] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            url = server.url
            print(f"redis-server :{server.port}, {args.partitions} partitions, {args.mb} MiB per "
                  f"size, ~1 MiB batches, {args.rounds} rounds + 1 warm-up", flush=True)
            for kib in (int(s) for s in args.sizes_kib.split(",")):
                assert server.proc is not None
                r, ratios, count = measure_size(url, server.port, server.proc.pid, args, kib)
                print(f"\n[{kib} KiB x {count} records]")
                print(rd.table(r))
                headlines += ratios
                section["sizes"][str(kib)] = {"records": count, "rows": rd.rows_doc(r)}  # type: ignore[index]
            fill(url, "commits", args.partitions, 1024, 20000)
            costs = commit_cost(url, "commits", str(Path(tmp) / "ckpt"), 64, 20)
        finally:
            server.kill()
    commit = {"median_ms": round(statistics.median(costs) * 1e3, 3),
              "max_ms": round(max(costs) * 1e3, 3)}
    print(f"\ncommitting offsets after a checkpoint ({args.partitions} partitions, 256 entries "
          f"acknowledged each): median {commit['median_ms']:.2f} ms, max {commit['max_ms']:.2f} ms")
    print()
    rd.print_headlines(headlines)
    section["commit_offsets"] = commit
    section["headlines"] = {h.name: h.doc() for h in headlines}
    rd.write_section(out, "consume", section, rd.machine())
    print(f"results: {out}")


if __name__ == "__main__":
    main()
