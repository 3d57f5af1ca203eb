"""Checkpoint benchmark: trainguard's CheckpointStore against raw writes, torch.save
and torch.distributed.checkpoint (DCP), on one disk, every write fsync'd.

    python bench/checkpoint.py --size-mib 1024 --tensors 20 --many 1000 --dir /path
    python bench/checkpoint.py --dist 4 --size-mib 256     # FSDP2 ranks vs DCP, in rounds

Prints a table (seconds, GiB/s) and a final line of the ratios the issue targets.
Not a test: numbers depend on the disk, the page cache (loads usually hit it; this
script cannot drop caches without root) and the CPU count.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint_store import CheckpointStore


def make_state(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    per = max(1, total_bytes // 4 // count)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(count)}


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Bench:
    def __init__(self, base: Path, nbytes: int):
        self.base = base
        self.nbytes = nbytes
        self.rows: list[tuple[str, float]] = []
        self.results: dict[str, float] = {}

    def fresh(self, name: str) -> Path:
        path = self.base / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def record(self, name: str, seconds: float, moved: bool = True) -> None:
        self.results[name] = seconds
        self.rows.append((name, seconds) if moved else (name + " *", seconds))


def raw_write(state: dict[str, torch.Tensor], path: Path) -> None:
    for name, t in state.items():
        fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(t.numpy()).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def run(args: argparse.Namespace) -> None:
    total = args.size_mib << 20
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    bench = Bench(base, total)
    state = make_state(total, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    target = {k: torch.zeros_like(v) for k, v in state.items()}  # load target, paged in
    rss_before = peak_rss_mib()

    # trainguard first, so the peak-RSS reading covers only its phases.
    store = CheckpointStore(bench.fresh("tg"), keep_last=2)
    t, _ = timed(lambda: store.save(state, step=1))
    bench.record("trainguard sync save", t)
    # The first async save allocates the staging buffer; the steady state reuses it.
    for step, label in ((2, "first"), (3, "steady")):
        t0 = time.perf_counter()
        handle = store.save(state, step=step, blocking=False)
        blocked = time.perf_counter() - t0
        handle.wait()
        durable = time.perf_counter() - t0
        bench.record(f"trainguard async save ({label}): blocked", blocked, moved=False)
        bench.record(f"trainguard async save ({label}): durable", durable)
    t, _ = timed(lambda: store.load(target))
    bench.record("trainguard load", t)
    assert all(torch.equal(target[k], state[k]) for k in state)
    tg_peak = peak_rss_mib() - rss_before
    store.close()
    target.clear()

    many = make_state(total, args.many)
    many_store = CheckpointStore(bench.fresh("tg-many"), keep_last=1)
    t, _ = timed(lambda: many_store.save(many, step=1))
    bench.record(f"trainguard sync save, {args.many} tensors", t)
    many_store.close()
    many.clear()

    raw_dir = bench.fresh("raw")
    t, _ = timed(lambda: raw_write(state, raw_dir))
    bench.record("raw write + fsync", t)

    buffers = {k: torch.empty_like(v) for k, v in state.items()}

    def copy_all() -> None:
        for k, v in state.items():
            buffers[k].copy_(v)

    copy_all()  # fault the pages in, as the staging pool's steady state has them
    t, _ = timed(copy_all)
    bench.record("copy into preallocated buffers", t, moved=False)
    buffers.clear()

    ts_dir = bench.fresh("torchsave")

    def torch_save() -> None:
        torch.save(state, ts_dir / "state.pt")
        fsync_tree(ts_dir)

    t, _ = timed(torch_save)
    bench.record("torch.save + fsync", t)
    t, _ = timed(lambda: torch.load(ts_dir / "state.pt", weights_only=True))
    bench.record("torch.load", t)

    if not args.no_dcp:
        run_dcp(bench, state)

    print_table(bench, nbytes, tg_peak, args)


def run_dcp(bench: Bench, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        store_path = bench.base / "dcp-pg"
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=0,
                                world_size=1)
    d1 = bench.fresh("dcp")

    def dcp_save() -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d1), sync_files=True))

    t, _ = timed(dcp_save)
    bench.record("DCP save", t)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    t, _ = timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(str(d1))))
    bench.record("DCP load", t)
    target.clear()
    d2 = bench.fresh("dcp-async")
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(d2), sync_files=True))
    blocked = time.perf_counter() - t0
    fut.result()
    bench.record("DCP async_save: blocked", blocked, moved=False)
    bench.record("DCP async_save: durable", time.perf_counter() - t0)
    dist.destroy_process_group()


def print_table(bench: Bench, nbytes: int, tg_peak: float, args: argparse.Namespace) -> None:
    gib = nbytes / 2**30
    print(f"\nstate: {nbytes / 2**20:.0f} MiB in {args.tensors} float32 tensors "
          f"(variant: {args.many} tensors); dir {bench.base}; {os.cpu_count()} CPUs")
    print(f"{'operation':48s} {'seconds':>9s} {'GiB/s':>8s}")
    for name, seconds in bench.rows:
        rate = f"{gib / seconds:8.2f}" if seconds > 0 else "       -"
        print(f"{name:48s} {seconds:9.3f} {rate}")
    print("(* = no I/O; GiB/s is the copy rate)")
    print(f"peak RSS growth during trainguard save/async/load: {tg_peak:.0f} MiB "
          f"(state {nbytes / 2**20:.0f} MiB; the staging pool and the verified chunks "
          "of a load each hold one copy)")
    r = bench.results
    ratios = [
        f"sync save vs raw write {r['raw write + fsync'] / r['trainguard sync save']:.2f}x",
        f"vs torch.save {r['torch.save + fsync'] / r['trainguard sync save']:.2f}x",
        f"async blocked (steady) / prealloc copy "
        f"{r['trainguard async save (steady): blocked'] / r['copy into preallocated buffers']:.2f}x",
        f"{args.many}-tensor / {args.tensors}-tensor save "
        f"{r[f'trainguard sync save, {args.many} tensors'] / r['trainguard sync save']:.2f}x",
    ]
    if "DCP load" in r:
        ratios.insert(2, f"load vs DCP load {r['DCP load'] / r['trainguard load']:.2f}x")
        ratios.append("DCP async blocked / prealloc copy "
                      f"{r['DCP async_save: blocked'] / r['copy into preallocated buffers']:.2f}x")
    print("ratios (higher is better for the first three, lower for the rest): "
          + "; ".join(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="state size (default 1024)")
    parser.add_argument("--tensors", type=int, default=20, help="tensor count (default 20)")
    parser.add_argument("--many", type=int, default=1000, help="tensor count of the variant")
    parser.add_argument("--dir", help="directory on the disk to measure (default: the temp "
                        "dir); the files go to a fresh subdirectory, removed afterwards")
    parser.add_argument("--no-dcp", action="store_true", help="skip the DCP rows")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    parser.add_argument("--dist", type=int, metavar="N", help="instead: N gloo ranks, an FSDP2 "
                        "model + AdamW of --size-mib parameters against DCP, in rounds "
                        "(bench/checkpoint_dist.py)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --dist (default 3)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where --dist keeps the state (cuda: one rank per GPU)")
    args = parser.parse_args()
    if args.dist:
        from checkpoint_dist import main as dist_main

        dist_main(args.dist, args.size_mib, args.rounds, args.device, args.dir)
        return
    # A fresh subdirectory, so cleaning up never touches anything already there.
    args.dir = tempfile.mkdtemp(prefix="tg-bench-", dir=args.dir)
    try:
        run(args)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
