"""Multi-rank checkpoint benchmark: an FSDP2 model + AdamW state saved and loaded by
trainguard's CheckpointStore and by DCP's FileSystemWriter/FileSystemReader, on the same
state, in interleaved rounds (trainguard, DCP, trainguard, DCP, ...), every write
fsync'd. Run through ``bench/checkpoint.py --dist N``:

    python bench/checkpoint.py --dist 4 --size-mib 256 --rounds 3 [--device cuda]

Prints, per metric, the median of the per-round ratios and their range:
save and load bandwidth against DCP's, ``async_save`` blocked time against a plain copy
of the same local state into preallocated buffers (the staging floor), and the bytes
each rank reads when a checkpoint of N ranks is loaded on N/2 (against its share).
Not a test: the numbers depend on the disk, the page cache and the CPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN = 2048  # one Linear(2048, 2048) layer: 16 MiB of float32 weights


def _rchar() -> int:
    """Bytes this process has read through read-like system calls (page cache hits too)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _model(size_mib: int, world: int, device: str) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, size_mib // 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    model.to(device)
    mesh = init_device_mesh(device, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _locals(state: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []
    if isinstance(state, dict):
        for v in state.values():
            out += _locals(v)
    elif isinstance(state, list | tuple):
        for v in state:
            out += _locals(v)
    elif isinstance(state, DTensor):
        out.append(state.to_local())
    elif isinstance(state, torch.Tensor):
        out.append(state)
    return out


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, base: Path, args: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from checkpoint_store import CheckpointStore

    device = args["device"]
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model, opt = _model(args["size_mib"], world, device)
    msd, osd = get_state_dict(model, opt)  # AdamW state initialized (exp_avg, exp_avg_sq)
    state = {"model": msd, "optim": osd}
    local = _locals(state)
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    out: dict[str, Any] = {"rank": rank, "local_bytes": local_bytes, "rounds": []}
    if args["mode"] == "reshard":
        # Load a checkpoint saved by more ranks, counting the bytes this rank reads.
        store = CheckpointStore(base / "tg-keep", io_threads=4)
        before = _rchar()
        seconds = _timed(lambda: store.load(state, strict=True))
        out.update(read=_rchar() - before, seconds=seconds)
        store.close()
    else:
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda")
                   for t in local]

        def copy() -> None:
            for b, t in zip(buffers, local):
                b.copy_(t, non_blocking=True)
            if device == "cuda":
                torch.cuda.synchronize()

        copy()  # fault the buffer pages in, as a steady-state staging pool has them
        # Two kept: a default load reads in place only when an earlier checkpoint is
        # there to fall back to, which a training job always has (keep_last=3).
        store = CheckpointStore(base / "tg-keep", keep_last=2, io_threads=4)
        # Non-blocking: the staging buffer exists from here on, as in a training job
        # after its first async save (the copy below has its buffers faulted in too).
        store.save(state, step=0, blocking=False).wait()

        def tg_load(step: int) -> None:
            manifest = store.load(state)
            assert manifest is not None and manifest.step == step, "loaded an older save"

        def drain() -> None:
            # A save returns once committed; retention's data removal then runs in the
            # store's writer thread. Let it finish untimed, so that it never slows the
            # DCP operation measured next (DCP's directories are removed untimed too).
            store._executor.submit(lambda: None).result()

        for r in range(1, args["rounds"] + 1):
            row: dict[str, float] = {}
            row["tg_save"] = _timed(lambda r=r: store.save(state, step=r))
            drain()
            d = base / f"dcp-{r}"
            row["dcp_save"] = _timed(lambda d=d: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(str(d), sync_files=True)))
            row["tg_load"] = _timed(lambda r=r: tg_load(r))
            row["dcp_load"] = _timed(lambda d=d: dcp.load(
                state, storage_reader=dcp.FileSystemReader(str(d))))
            dist.barrier()
            t0 = time.perf_counter()
            handle = store.save(state, step=1000 + r, blocking=False)
            row["tg_async_blocked"] = time.perf_counter() - t0
            handle.wait()
            drain()
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(
                str(base / f"dcp-async-{r}"), sync_files=True))
            row["dcp_async_blocked"] = time.perf_counter() - t0
            fut.result()
            row["copy"] = _timed(copy)
            out["rounds"].append(row)
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                shutil.rmtree(base / f"dcp-async-{r}", ignore_errors=True)
        # Leave one committed checkpoint for the reshard phase.
        store.save(state, step=10_000)
        store.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def _launch(mode: str, world: int, base: Path, args: dict[str, Any]) -> list[dict[str, Any]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = json.dumps({**args, "mode": mode})
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(r), str(world), str(port),
                               str(base), spec], stdout=subprocess.PIPE) for r in range(world)]
    outs = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a benchmark rank failed (exit {p.returncode})")
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return outs


def _summary(name: str, values: list[float], target: str) -> str:
    return (f"{name:44s} median {statistics.median(values):6.2f}x  range "
            f"{min(values):.2f}-{max(values):.2f}  (target {target})")


def run(world: int, size_mib: int, rounds: int, device: str, base: Path) -> list[str]:
    """Both phases; returns the summary lines (also printed)."""
    args = {"size_mib": size_mib, "rounds": rounds, "device": device}
    saved = _launch("rounds", world, base, args)
    total = sum(o["local_bytes"] for o in saved)
    rows = saved[0]["rounds"]  # barrier-to-barrier times: every rank's span
    print(f"\nFSDP2 + AdamW state: {total / 2**20:.0f} MiB over {world} ranks ({device}); "
          f"{rounds} rounds, trainguard and DCP alternating; {os.cpu_count()} CPUs")
    print(f"{'round':>5s} {'tg save':>9s} {'DCP save':>9s} {'tg load':>9s} {'DCP load':>9s} "
          f"{'tg async':>9s} {'DCP async':>9s} {'copy':>9s}   (seconds; async = blocked)")
    for i, r in enumerate(rows):
        print(f"{i:5d} {r['tg_save']:9.3f} {r['dcp_save']:9.3f} {r['tg_load']:9.3f} "
              f"{r['dcp_load']:9.3f} {r['tg_async_blocked']:9.3f} {r['dcp_async_blocked']:9.3f} "
              f"{r['copy']:9.3f}")
    lines = [
        _summary("save bandwidth vs DCP FileSystemWriter",
                 [r["dcp_save"] / r["tg_save"] for r in rows], ">= 1.2x"),
        _summary("load bandwidth vs DCP FileSystemReader",
                 [r["dcp_load"] / r["tg_load"] for r in rows], ">= 1.5x"),
        _summary("async_save blocked / staging copy",
                 [max(o["rounds"][i]["tg_async_blocked"] for o in saved) / r["copy"]
                  for i, r in enumerate(rows)], "<= 1.5x"),
        _summary("(DCP async_save blocked / staging copy)",
                 [max(o["rounds"][i]["dcp_async_blocked"] for o in saved) / r["copy"]
                  for i, r in enumerate(rows)], "for reference"),
    ]
    half = max(1, world // 2)
    if half != world and device == "cpu":
        loaded = _launch("reshard", half, base, args)
        share = total / half
        lines.append(_summary(f"bytes read per rank, {world}->{half} reshard / share",
                              [o["read"] / share for o in loaded], "<= 1.1x"))
    print("\n".join(lines))
    return lines


def main(world: int, size_mib: int, rounds: int, device: str, directory: str | None) -> None:
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="tg-bench-dist-", dir=directory))
    try:
        run(world, size_mib, rounds, device, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]),
               json.loads(sys.argv[6]))
